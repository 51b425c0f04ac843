"""dgemma: run, serve and fine-tune DiffusionGemma block-diffusion language models."""

__version__ = "0.1.0"
__all__ = ["Grammar", "Model", "Result", "StreamEvent", "load", "__version__"]


def __getattr__(name: str):
    # Lazy: `dgemma --help` and sub-commands should not pay for importing torch up front.
    if name in ("Model", "Result", "StreamEvent", "load"):
        from dgemma import api

        return getattr(api, name)
    if name == "Grammar":
        from dgemma.sampling import Grammar

        return Grammar
    raise AttributeError(f"module 'dgemma' has no attribute {name!r}")
