"""Eval-only runs: score a HuggingFace model as a search agent (the same agent loop, tools and rewards as training).

`run_eval(config)` is `rlsearch eval`; `evaluate(generate, config)` scores any rollout worker's `generate` (the
trainer's periodic eval). Results are resumable: re-running into the same output dir skips what is scored.
"""

from .metrics import OVERALL, render_hops_table, render_table, summarize, summarize_by_hops
from .results import ResultsFile, result_key
from .runner import (
    EVAL_STEP,
    EvalQuestion,
    EvalRun,
    EvalSummary,
    GenerateFn,
    evaluate,
    load_eval_questions,
    rollout_engines,
    run_eval,
)

__all__ = [
    "EVAL_STEP", "OVERALL", "EvalQuestion", "EvalRun", "EvalSummary", "GenerateFn", "ResultsFile", "evaluate",
    "load_eval_questions", "render_hops_table", "render_table", "result_key", "rollout_engines", "run_eval",
    "summarize", "summarize_by_hops",
]
