"""Complete a text-only checkpoint for transformers: write the vision-tower weights it lacks (freshly initialised
by transformers from the checkpoint's own vision_config; dgemma never reads them) as a second shard, so that
`DiffusionGemmaForBlockDiffusion.from_pretrained` loads it without MISSING-weight warnings. The existing
model.safetensors is renamed, not rewritten (its bytes stay the same).

    python scripts/add_vision_shard.py dgemma/assets/demo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main(directory: Path) -> None:
    import transformers
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if not missing:
        print("nothing missing")
        return
    state = model.state_dict()
    text_file, vision_file = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({k: state[k].contiguous() for k in missing}, str(directory / vision_file), metadata={"format": "pt"})
    (directory / "model.safetensors").rename(directory / text_file)
    with safe_open(str(directory / text_file), "pt") as f:
        weight_map = {k: text_file for k in f.keys()} | {k: vision_file for k in missing}
    size = sum((directory / f).stat().st_size for f in (text_file, vision_file))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"wrote {len(missing)} vision tensors to {vision_file}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
