"""`strata generate`'s demo defaults, --stop, --ctx and the OpenAI penalties, and the Python API's
`stop=` and `load(max_context=)` they stand on."""

import pytest

import strata
from strata.cli.main import main
from strata.default_model import DEMO_SAMPLING, EMBEDDED
from strata.errors import StrataError
from strata.testing.models import make_model

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def embedded():
    with strata.load(EMBEDDED) as model:
        yield model


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("opts") / "tiny", "tiny", seed=0)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_demo_samples_with_its_defaults_and_echoes_the_prompt(embedded, capsys):
    code, out, _ = run(capsys, "generate", PROMPT, "-n", "24")
    assert code == 0
    demo = strata.generate(embedded, PROMPT, max_tokens=24, seed=0, **DEMO_SAMPLING)
    greedy = strata.generate(embedded, PROMPT, max_tokens=24)
    assert demo.text != greedy.text
    assert out == PROMPT + demo.text + "\n"
    code, out, _ = run(capsys, "generate", "default", PROMPT, "-n", "24", "--seed", "5")  # --seed keeps the demo
    assert out == PROMPT + strata.generate(embedded, PROMPT, max_tokens=24, seed=5, **DEMO_SAMPLING).text + "\n"


def test_any_sampling_flag_starts_from_greedy(embedded, capsys):
    code, out, _ = run(capsys, "generate", PROMPT, "-n", "24", "--temp", "0")
    assert code == 0 and out == PROMPT + strata.generate(embedded, PROMPT, max_tokens=24).text + "\n"
    code, out, _ = run(capsys, "generate", PROMPT, "-n", "24", "--repeat-penalty", "1.3", "--quiet")
    assert out == strata.generate(embedded, PROMPT, max_tokens=24, repeat_penalty=1.3).text + "\n"  # no echo


def test_other_models_stay_greedy_and_unechoed(made, capsys):
    code, out, _ = run(capsys, "generate", str(made.model_path), "hello", "-n", "8")
    with strata.load(made.model_path) as model:
        assert code == 0 and out == strata.generate(model, "hello", max_tokens=8).text + "\n"


def test_openai_penalties_on_the_command_line(made, capsys):
    with strata.load(made.model_path) as model:
        want = strata.generate(model, "hello", max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5).text
    code, out, _ = run(capsys, "generate", str(made.model_path), "hello", "-n", "12", "--frequency-penalty", "1.5",
                       "--presence-penalty", "0.5")
    assert code == 0 and out == want + "\n"
    code, _, err = run(capsys, "generate", str(made.model_path), "hello", "--presence-penalty", "3")
    assert code == 2 and err.strip() == "error: --presence-penalty: must be in [-2, 2] (0: off), got 3.0"


def test_stop_strings_cut_the_text_in_the_api_and_on_the_command_line(embedded, capsys):
    full = strata.generate(embedded, PROMPT, max_tokens=40)
    assert "\n" in full.text[1:]
    cut_at = full.text.index("\n", 1)  # the first newline after the first character
    stop = full.text[cut_at:cut_at + 2]
    cut = strata.generate(embedded, PROMPT, max_tokens=40, stop=["zzz", stop])
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.stop_string == stop and len(cut.tokens) < len(full.tokens)
    streamed = "".join(r.text for r in strata.stream_generate(embedded, PROMPT, max_tokens=40, stop=stop))
    assert streamed == cut.text  # nothing past the stop string is ever yielded
    escaped = stop.replace("\n", "\\n")
    code, out, err = run(capsys, "generate", PROMPT, "-n", "40", "--temp", "0", "--stop", escaped, "--quiet")
    assert code == 0 and out == cut.text + "\n"
    with pytest.raises(ValueError, match="stop: expected a non-empty string"):
        strata.generate(embedded, PROMPT, stop=[""])


def test_ctx_holds_the_model_to_fewer_positions(made, capsys):
    with strata.load(made.model_path, max_context=12) as model:
        assert model.cfg.max_context == 12 and model.native_context == 256
        r = strata.generate(model, "hello", max_tokens=50)
        assert r.finish_reason == "context" and r.prompt_tokens + len(r.tokens) <= 13
        with pytest.raises(StrataError, match="limited to 12 of 256 at load: max_context"):
            strata.generate(model, "hello world, a longer prompt")
    with pytest.raises(ValueError, match="max_context: 300 is more than the model's context of 256"):
        strata.load(made.model_path, max_context=300)
    code, _, err = run(capsys, "generate", str(made.model_path), "hello", "-n", "50", "--ctx", "12")
    assert code == 0 and "finish: context" in err
    code, _, err = run(capsys, "generate", str(made.model_path), "hello", "--ctx", "300")
    assert code == 2 and err.strip() == "error: --ctx: 300 is more than the model's context of 256"
