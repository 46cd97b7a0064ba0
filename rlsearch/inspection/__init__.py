"""`rlsearch inspect RUN_DIR`: an incremental SQLite index over a run's trajectory JSONL, the questions researchers
ask of it (one question across steps, groups without reward variance, tool errors, answers found without searching,
reward without a correct answer, staleness, cuts by reason, a per-step overview) as text tables, and an HTML page
of trajectories turn by turn and token by token."""

from .index import INDEX_FILE, IndexUpdate, InspectError, open_index, update_index
from .page import MAX_PAGE_TRAJECTORIES, WrittenPage, write_page
from .queries import (
    answers_without_search,
    default_source,
    find_questions,
    format_only_rewards,
    overview,
    question_history,
    staleness,
    tool_errors,
    truncations,
    uniform_groups,
    uniform_groups_per_step,
)
from .report import QUERY_NAMES, format_table, inspect_command

__all__ = [
    "INDEX_FILE", "MAX_PAGE_TRAJECTORIES", "QUERY_NAMES", "IndexUpdate", "InspectError", "WrittenPage",
    "answers_without_search", "default_source", "find_questions", "format_only_rewards", "format_table",
    "inspect_command", "open_index", "overview", "question_history", "staleness", "tool_errors", "truncations",
    "uniform_groups",
    "uniform_groups_per_step", "update_index", "write_page",
]
