"""What the terminal shows when a run fails because one of its processes failed: a rollout engine, an actor rank or a
tool server. The driver only sees the call that found it dead (a Ray error, vLLM's "EngineDeadError: ... See stack
trace (above) for the root cause"); the root cause is what that process wrote, in its own file under the run's logs
dir (`redirect_worker_output`: ``<role>-<pid>.log``). So the failure is reported by the process's own error lines and
that file's path, without the driver's traceback, when the driver's error is that failure as Ray reported it (or
raised from it); a driver error raised while handling one (a failure of the driver's own) keeps its traceback."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# a Python exception's last line, e.g. "RuntimeError: Unsupported CPU attention configuration: head_dim=16" or
# "ray.exceptions.RayTaskError(ValueError): ..." (the type may be qualified; Ray adds the cause's type in brackets)
ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))"
                        r"(?:\([\w.]+\))?: (.+)$")
# errors that only say that another process failed: never the root cause
WRAPPERS = {"EngineDeadError", "RayTaskError", "RayActorError", "ActorDiedError", "ActorUnavailableError",
            "WorkerCrashedError", "WorkerDiedError", "RaySystemError"}
# Ray's errors whose message names the process they come from ("pid=4242", "pid: 4242"); another error's text may name
# a pid (a server's, in a message of the driver's) without coming from that process
RAY_REPORTS = WRAPPERS | {"OutOfMemoryError"}
ROLES = (("rollout-engine", "rollout engine"), ("actor-rank", "actor rank "), ("retriever", "retrieval server"),
         ("mcp", "MCP server"))
LOG_TAIL_BYTES = 256 * 1024  # the end of a process's log is where it failed
MAX_LINES = 3
# Ray's account of a worker that died without raising (a signal, the kernel's or Ray's own memory monitor)
RAY_DEATH = re.compile(r"Worker exit type: (\w+) Worker exit detail: (.+)", re.S)
DEATH_CHARS = 400


@dataclass(frozen=True)
class ProcessFailure:
    process: str  # e.g. "the rollout engine in process 9199"
    errors: tuple[str, ...]  # its own error lines, the earliest (the root cause) first
    log: Path | None  # its log file, when the run's logs dir holds one
    death: str = ""  # what Ray says of how it died, when it died without raising (e.g. "SYSTEM_ERROR: ...")
    # the driver's error is this failure as Ray reported it (or raised from it), and the process says why (its own
    # error lines, or Ray's account of its death): the driver's traceback adds nothing
    explains_driver_error: bool = False

    def render(self, command: str) -> str:
        """The lines to print (rlsearch COMMAND: ...), without a traceback."""
        silent = f"it died without an error line of its own; Ray: {self.death}" if self.death else (
            "(no error line of its own: see its log)")
        first, *rest = self.errors or (silent,)
        lines = [f"rlsearch {command}: {self.process} failed: {first}"]
        lines += [f"  then: {line}" for line in rest]
        if self.log is not None:
            lines.append(f"  its log (the rest of what it wrote): {self.log}")
        return "\n".join(lines)


def process_failure(error: BaseException, log_dir: Path | None) -> ProcessFailure | None:
    """The failure of the run's process that `error` (raised in the driver) comes from, with its own error lines:
    the exception it raised itself first, then those of its log in `log_dir`. None when `error` comes from no other
    process (a Ray error names the process's pid)."""
    pid, cause, reported = None, None, False
    for link, raised_from in _chain(error):
        if not pid:
            pid, reported = _reported_pid(link), raised_from
        own = getattr(link, "cause", None)  # a RayTaskError's: the exception the process raised
        if cause is None and own is not None and type(own).__name__ not in WRAPPERS:
            cause = own
    if not pid:
        return None
    log = next(iter(sorted(log_dir.glob(f"*-{pid}.log"))), None) if log_dir is not None else None
    errors = _error_lines(log) if log is not None else []
    if cause is not None:
        raised = f"{type(cause).__name__}: {cause}".strip().splitlines()[0]
        errors = [raised] + [line for line in errors if line != raised]
    death = ray_death(error)
    return ProcessFailure(_describe(log, pid), tuple(errors[:MAX_LINES]), log, death,
                          explains_driver_error=reported and bool(errors or death))


def _chain(error: BaseException) -> Iterator[tuple[BaseException, bool]]:
    """Each error of the chain, and whether every error before it was raised from the next (`raise ... from`), not
    while handling it."""
    seen: set[int] = set()
    raised_from = True
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error, raised_from
        raised_from = raised_from and error.__cause__ is not None
        error = error.__cause__ or error.__context__


def _reported_pid(error: BaseException) -> int | None:
    """The pid of the process a Ray error comes from: a RayTaskError's attribute, or in the message of Ray's other
    errors ("(pid=4242, ip=...)" of a task, "pid: 4242" of a dead actor)."""
    if getattr(error, "pid", None):
        return error.pid
    match = re.search(r"\bpid(?:=|: )(\d+)", str(error)) if _is_ray_report(error) else None
    return int(match[1]) if match else None


def _is_ray_report(error: BaseException) -> bool:
    """One of Ray's errors, or a class Ray made of one and the process's own (a task's "RayTaskError(ValueError)")."""
    return any(cls.__name__ in RAY_REPORTS for cls in type(error).__mro__)


def ray_death(error: BaseException) -> str:
    """How Ray says the process died, its exit type and the detail's first sentences (a process killed by a signal,
    by the kernel's OOM killer or by Ray's memory monitor leaves no error line of its own); empty when Ray says
    nothing of it."""
    for link, _ in _chain(error):
        text = " ".join(str(link).split())
        match = RAY_DEATH.search(text)
        if match:
            return f"{match[1]}: {_first_sentences(match[2])}"
        if type(link).__name__ == "OutOfMemoryError":  # a task's worker that Ray's memory monitor killed
            return f"OUT_OF_MEMORY: {_first_sentences(text)}"
    return ""


def _first_sentences(text: str) -> str:
    if len(text) <= DEATH_CHARS:
        return text
    end = text.rfind(". ", 0, DEATH_CHARS)
    return text[:end + 1] if end > 0 else text[:DEATH_CHARS] + " ..."


def _error_lines(log: Path) -> list[str]:
    """The distinct exception lines of `log`'s end, in order, without those that only report another failure."""
    with log.open("rb") as file:
        file.seek(max(0, log.stat().st_size - LOG_TAIL_BYTES))
        text = file.read().decode("utf-8", errors="replace")
    lines: list[str] = []
    for line in text.splitlines():
        match = ERROR_LINE.match(line.strip()) if not line.startswith((" ", "\t")) else None
        if match and match[1] not in WRAPPERS and line.strip() not in lines:
            lines.append(line.strip())
    return lines


def _describe(log: Path | None, pid: int) -> str:
    if log is not None:
        for prefix, role in ROLES:
            if log.name.startswith(prefix):
                detail = log.name.removeprefix(prefix).removesuffix(f"-{pid}.log")
                return f"the {role}{detail} in process {pid}"
    return f"the process {pid}"
