"""bench/trl_peer.py's table and figure: the two sides do not do equal work, and the report says how they differ."""

from __future__ import annotations

from bench.trl_peer import GENERATION_BACKENDS, report


def _steps(seconds: list[float], prompt_tokens: float, generation: str) -> list[dict]:
    return [dict(step=step, seconds=s, tokens=100.0, reward=0.5, tool_calls=1.0, prompt_tokens=prompt_tokens,
                 generation=generation) for step, s in enumerate(seconds, 1)]


def test_the_report_shows_each_sides_prompt_tokens_and_backend_and_what_the_ratio_measures(capsys) -> None:
    report({"TRL": _steps([200.0, 170.0], 249, GENERATION_BACKENDS["transformers"]),
            "rlsearch": _steps([30.0, 17.0], 59, GENERATION_BACKENDS["rlsearch"])})
    header, _, trl_first, _, rlsearch_first, _, figure = capsys.readouterr().out.splitlines()
    assert "prompt tokens" in header and "generation" in header
    assert trl_first.startswith("TRL") and trl_first.split()[-2:] == ["249", "transformers"]
    assert rlsearch_first.startswith("rlsearch      1") and rlsearch_first.split()[-3:] == ["59", "vLLM", "engines"]
    assert figure.startswith("rlsearch step / TRL step (goal <= 0.7): 0.10, the wall time of a step")
    assert "not equal work: prompts of 249 vs 59 tokens (TRL vs rlsearch), transformers vs vLLM engines" in figure
