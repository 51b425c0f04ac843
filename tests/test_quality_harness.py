"""The quality harness (benchmarks/quality/): the task generator's answers recomputed from the prompts, the exact-match
checker on known cases, and the evaluation run on the bundled model for a few examples."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quality"))
import evaluate as harness  # noqa: E402
import tasks  # noqa: E402

import dgemma  # noqa: E402
from dgemma.api import DEMO_MODEL  # noqa: E402
from dgemma.errors import DgemmaError  # noqa: E402
from dgemma.tokenizer import Tokenizer  # noqa: E402


def recompute(example: tasks.Example) -> str:
    """Each task's answer from its prompt alone."""
    words = example.prompt.split()
    if example.task in ("copy", "reverse", "sort"):
        digits = words[1]
        return {"copy": digits, "reverse": digits[::-1], "sort": "".join(sorted(digits))}[example.task]
    if example.task == "inc":
        return "".join("0123456789"[("0123456789".index(d) + 1) % 10] for d in words[1])
    if example.task == "recall":
        pairs, asked = example.prompt.split("?")
        values = dict(pair.split("=") for pair in pairs.split(","))
        return ",".join(values[key] for key in asked.split(","))
    fields = [field.split("=") for field in words[1].split(",")]
    return "{" + ",".join(f'"{k}":{int(v)}' for k, v in fields) + "}"


def test_examples_are_seeded_and_cycle_through_the_tasks():
    a, b = tasks.examples(24, 5), tasks.examples(24, 5)
    assert a == b and a != tasks.examples(24, 6)
    assert [e.task for e in a[:6]] == list(tasks.TASKS)
    assert [e.task for e in tasks.examples(4, 0, ("sort", "inc"))] == ["sort", "inc", "sort", "inc"]


@pytest.mark.parametrize("harness_name", list(tasks.HARNESSES))
def test_answers_match_an_independent_computation(harness_name):
    for example in tasks.examples(600, 3, size=tasks.HARNESSES[harness_name]):
        assert example.answer == recompute(example), example
    json_answers = [e.answer for e in tasks.examples(60, 3, size=tasks.HARNESSES[harness_name]) if e.task == "json"]
    assert all(isinstance(json.loads(a), dict) for a in json_answers)


def test_the_long_harness_asks_for_longer_answers():
    short, long = (tasks.examples(600, 3, size=tasks.HARNESSES[h]) for h in ("short", "long"))
    for task in ("copy", "reverse", "sort", "inc"):
        assert max(len(e.answer) for e in short if e.task == task) == 7
        assert {len(e.answer) for e in long if e.task == task} == set(range(10, 21))
    assert {len(json.loads(e.answer)) for e in long if e.task == "json"} == {3}
    assert {e.answer.count(",") for e in long if e.task == "recall"} == {2}  # three keys asked


@pytest.mark.parametrize("harness_name", list(tasks.HARNESSES))
def test_answers_fit_one_canvas_of_the_harness_checkpoint(harness_name):
    tok, size = Tokenizer(DEMO_MODEL), tasks.HARNESSES[harness_name]
    config = train_script().model_config(size)
    assert config["canvas_length"] == size.canvas
    for example in tasks.examples(600, 4, size=size):
        assert len(tok.encode(example.answer, add_bos=False)) + 1 <= size.canvas  # + the closing <end_of_turn>


def train_script():
    sys.path.insert(0, str(Path(tasks.__file__).parent))
    import train

    return train


def test_a_checkpoint_records_its_harness(tmp_path):
    every = tuple(tasks.TASKS)
    assert tasks.read_harness(tmp_path) == ("short", tasks.TRAIN_EXAMPLES, every)  # from before the record
    (tmp_path / tasks.HARNESS_FILE).write_text('{"harness": "long", "train_examples": 1234}')  # before the task list
    assert tasks.read_harness(tmp_path) == ("long", 1234, every)
    tasks.write_harness(tmp_path, "long", 1234, ("copy", "inc"))
    assert tasks.read_harness(tmp_path) == ("long", 1234, ("copy", "inc"))
    long = tasks.evaluation_set(5, ("copy",), 1234, tasks.HARNESSES["long"])
    assert all(len(e.answer) >= 10 for e in long)


def test_a_checkpoint_of_some_tasks_is_scored_on_prompts_it_never_trained_on():
    """3,000 copy-only examples take about half of the 1,000 three-digit copy prompts; the evaluation set of such a
    checkpoint avoids them, which the all-task training set of the same size would not."""
    copy_only = {e.prompt for e in tasks.examples(3000, tasks.TRAIN_SEED, ("copy",))}
    chosen = tasks.evaluation_set(60, ("copy",), 3000, trained=("copy",))
    assert len(chosen) == 60 and not copy_only & {e.prompt for e in chosen}
    assert copy_only & {e.prompt for e in tasks.evaluation_set(60, ("copy",), 3000)}


def test_server_benchmark_asks_the_tasks_the_checkpoint_learned(tmp_path):
    """benchmarks/early_commit.py --harness-prompts: held-out prompts of the recorded tasks only, in turn."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import early_commit

    tasks.write_harness(tmp_path, "long", 3000, ("copy", "inc"))
    chosen = early_commit.harness_examples(str(tmp_path), 7)
    assert [e.task for e in chosen] == ["copy", "inc"] * 3 + ["copy"]
    assert all(len(e.answer) >= 10 for e in chosen)  # the long harness's sizes
    trained = {e.prompt for e in tasks.examples(3000, tasks.TRAIN_SEED, ("copy", "inc"), tasks.HARNESSES["long"])}
    assert not trained & {e.prompt for e in chosen}


def test_task_lists_are_checked():
    assert tasks.parse_tasks(" copy, inc ") == ("copy", "inc")
    for bad, message in (("copy,add", "unknown task.s. add"), (" , ", "no task given")):
        with pytest.raises(ValueError, match=message):
            tasks.parse_tasks(bad)


def test_checker_scores_right_answers_right_and_wrong_ones_wrong():
    example = tasks.Example("sort", "sort 312", "123")
    assert tasks.is_correct(example, "123")
    assert tasks.is_correct(example, " 123\n")  # surrounding whitespace aside
    for wrong in ("132", "1234", "12", "", "12 3", "0123"):
        assert not tasks.is_correct(example, wrong), wrong


def test_held_out_examples_never_repeat_a_training_prompt():
    train = {e.prompt for e in tasks.examples(3000, 0, ("json",))}  # 2,200 prompts: most are taken
    held = tasks.held_out(200, 1, train, ("json",))
    assert len(held) == 200 and not train & {e.prompt for e in held}


def test_held_out_prompts_that_do_not_exist_are_an_error_not_a_hang():
    every = {f"json {k}={v}" for k in tasks.KEYS for v in range(100)}  # the short json task's whole prompt space
    with pytest.raises(ValueError, match="only 0 held-out prompts of json"):  # looped forever before
        tasks.held_out(5, 1, every, ("json",))


def test_the_evaluation_set_asks_no_training_prompt():
    chosen = tasks.evaluation_set(40, ("json", "copy"), n_train=6000)
    train = {e.prompt for e in tasks.examples(6000, 0)}  # train.py's training set of that size (seed 0)
    assert [e.task for e in chosen] == ["json", "copy"] * 40
    assert len({e.prompt for e in chosen}) == 80 and not train & {e.prompt for e in chosen}
    assert any(e.prompt in train for e in tasks.examples(80, 2, ("json",)))  # the draw alone would repeat some


def test_variants_are_chosen_by_name_or_given_as_json():
    chosen = harness.choose_variants("max_steps_8", ['four={"max_denoising_steps": 4}'])
    assert chosen == {"defaults": {}, "max_steps_8": {"max_denoising_steps": 8}, "four": {"max_denoising_steps": 4}}
    with pytest.raises(DgemmaError):
        harness.choose_variants("no_such_variant", [])
    with pytest.raises(DgemmaError):
        harness.choose_variants("", ["broken={"])


@pytest.fixture(scope="module")
def model():
    return dgemma.load(dtype="float32")


def test_decode_scores_the_output_it_streams(model):
    """The score of a decode is exact match on the text it streamed: an answer equal to that text (same seed)
    is right, the same text with one more character wrong."""
    example = tasks.examples(1, 2, ("copy",))[0]
    options = {"max_new_tokens": 6, "max_denoising_steps": 4}
    first = harness.decode(model, example, options, seed=7)
    assert first["output"] and not first["correct"]  # the bundled model does not know the task
    same = tasks.Example("copy", example.prompt, first["output"].strip())
    assert harness.decode(model, same, options, seed=7)["correct"]
    other = tasks.Example("copy", example.prompt, first["output"].strip() + "x")
    assert not harness.decode(model, other, options, seed=7)["correct"]


def test_unknown_or_invalid_options_are_refused_before_decoding(model):
    harness.check_variants(model, {"defaults": {}, "ar": {"mode": "autoregressive", "max_denoising_steps": 4}})
    for bad in ({"no_such_option": 1}, {"entropy_bound": -1.0}, {"mode": "sideways"}):
        with pytest.raises(DgemmaError, match="variant bad"):
            harness.check_variants(model, {"defaults": {}, "bad": bad})


def test_evaluation_on_the_bundled_model(model):
    examples = tasks.examples(2, 2, ("copy", "recall"))
    variants = {"defaults": {}, "one_step": {"max_denoising_steps": 1}, "autoregressive": {"mode": "autoregressive"}}
    report = harness.evaluate(model, examples, variants, seed=0, common={"max_new_tokens": 8})
    res = report["variants"]
    assert set(res) == set(variants) and set(res["defaults"]["tasks"]) == {"copy", "recall"}
    for name, r in res.items():
        o = r["overall"]
        assert o["examples"] == 2 and o["correct"] == 0 and o["flops_per_answer"] > 0
        assert all(r["tasks"][t]["examples"] == 1 for t in ("copy", "recall"))
        assert len(report["outputs"][name]) == 2 and report["correct"][name] == [False, False]
    # one denoising step, 8 tokens in one 32-position canvas: one decoder pass per answer
    assert res["one_step"]["overall"]["decoder_passes"] == 2
    assert res["defaults"]["overall"]["decoder_passes"] > 2  # the adaptive defaults take more steps
    assert res["one_step"]["overall"]["flops_per_answer"] < res["defaults"]["overall"]["flops_per_answer"]
    # the one-pass floor: what one pass per canvas costs, which is exactly what the one-step variant spent
    one, base = res["one_step"]["overall"], res["defaults"]["overall"]
    assert one["one_pass_flops_per_token"] == pytest.approx(one["flops_per_token"], rel=1e-12)
    assert base["one_pass_flops_per_token"] < base["flops_per_token"]
    assert report["vs_defaults"]["one_step"]["one_pass_floor_ratio"] == pytest.approx(
        one["flops_per_token"] / base["flops_per_token"])
    ar = res["autoregressive"]["overall"]  # one pass per token, plus the EOS when an answer stopped early
    assert ar["tokens"] <= ar["decoder_passes"] <= ar["tokens"] + 2
    assert report["vs_defaults"]["defaults"]["flops_per_token_ratio"] == 1.0
    assert report["vs_defaults"]["one_step"]["accuracy_points"] == 0.0
    same = sum(a == b for a, b in zip(report["outputs"]["one_step"], report["outputs"]["defaults"]))
    assert report["vs_defaults"]["one_step"]["same_answer_percent"] == 50 * same
    assert report["vs_defaults"]["defaults"]["same_answer_percent"] == 100


def test_held_out_likelihood_of_the_bundled_model_beats_a_uniform_guess():
    nll = harness.heldout_nll(None, harness.HELDOUT, "float32", draws=1, max_windows=4)
    assert nll["windows"] == 4
    for key in ("diffusion_nats_per_token", "autoregressive_nats_per_token"):
        assert 0 < nll[key] < math.log(4096), nll  # a trained model, scored right, beats log(vocabulary)
