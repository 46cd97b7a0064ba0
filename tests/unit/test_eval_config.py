"""The eval config: loads the example, and every start-up error names the key (through the CLI)."""

import pytest

from rlsearch.cli import main
from rlsearch.config import ConfigError, EvalConfig, load_eval_config
from tests.constants import REPO_ROOT

EXAMPLE = str(REPO_ROOT / "examples/configs/eval_search.yaml")


@pytest.fixture
def valid_overrides(tiny_model_dir, toy_data):
    return [
        f"model.path={tiny_model_dir}", f"eval.files=[{toy_data.test}]", f"tools.retriever.corpus={toy_data.corpus}",
    ]


def test_example_config_loads(valid_overrides):
    config = load_eval_config(EXAMPLE, [*valid_overrides, "output_dir=/tmp/somewhere", "eval.n_samples=4"])
    assert config.output_dir == "/tmp/somewhere"
    assert config.eval.n_samples == 4
    assert config.rollout.protocol == "search_r1"


def test_decoding_is_greedy_unless_configured():
    assert EvalConfig().rollout.temperature == 0.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.n_sample=2", "unknown config key 'eval.n_sample'; did you mean 'eval.n_samples'?"),
        ("model.path=/no/such/model", "'model.path' is not a HuggingFace model dir (no config.json): /no/such/model"),
        ("eval.files=[/no/such/file.jsonl]", "'eval.files[0]' not found: /no/such/file.jsonl"),
        ("eval.n_samples=0", "'eval.n_samples' must be > 0"),
        ("rollout.protocol=xml", "'rollout.protocol' must be one of"),
    ],
)
def test_cli_rejects_a_bad_config_naming_the_key(capsys, valid_overrides, override, message):
    assert main(["eval", "--config", EXAMPLE, *valid_overrides, override]) == 2
    assert message in capsys.readouterr().err


def test_several_greedy_samples_are_rejected(valid_overrides):
    with pytest.raises(ConfigError, match=r"'eval\.n_samples'=2 with greedy decoding"):
        load_eval_config(EXAMPLE, [*valid_overrides, "eval.n_samples=2", "rollout.temperature=0"])
