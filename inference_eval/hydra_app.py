"""The CLI boundary shared by every entry point: Hydra plumbing and how errors are reported.

Each Hydra CLI has one typed dataclass config (its schema) registered in the ConfigStore and
one primary YAML in conf/ that lists the schema first in its defaults; groups (target/, data/,
head/, ...) fill typed fields. `OmegaConf.to_object` then builds the dataclasses, so every
`__post_init__` validates its keys before any work starts: a bad key fails in a second, named,
not an hour into a run.

Errors (the rule for the whole project): bad input raises ValueError (json.JSONDecodeError
included) or an OSError such as FileNotFoundError, with a message naming the file, line or
key and the fix. At the boundary (`user_errors`, used by `run_cli` and by train.export's
argparse main) such an error prints as one line, `error: <message>` (`config error: ...`
for a bad override, preset or config value) on stderr, and the process exits 2. Any other
exception (RuntimeError, TypeError, KeyError, AssertionError, ...) is a bug and keeps its full
traceback. HYDRA_FULL_ERROR=1 shows the traceback of a user error too.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
USER_ERRORS = (ValueError, OSError)
USER_ERROR_EXIT = 2
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # Hydra's own switch for complete stack traces


def register_schema(config_name: str, schema: type) -> None:
    ConfigStore.instance().store(name=f"{config_name}_schema", node=schema)


def to_config(cfg: Any) -> Any:
    """DictConfig -> typed dataclass tree (validation errors surface here, naming the key)."""
    return OmegaConf.to_object(cfg)


def compose(config_name: str, schema: type, overrides: Sequence[str] = ()) -> Any:
    """Compose a CLI's config without running it (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema(config_name, schema)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_config(hydra_compose(config_name=config_name, overrides=list(overrides)))


def one_line(exc: BaseException) -> str:
    """The exception's message with its lines joined (Hydra's and some libraries' span
    several), or its type name when it has none."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def full_traces() -> bool:
    return os.environ.get(FULL_ERROR_ENV) == "1"


def exit_user_error(exc: BaseException | str, label: str = "error") -> NoReturn:
    message = exc if isinstance(exc, str) else one_line(exc)
    print(f"{label}: {message}", file=sys.stderr)
    raise SystemExit(USER_ERROR_EXIT) from None


def hydra_message(exc: BaseException) -> str:
    """One line of a Hydra composition error: its message without the config search path it
    appends, then the OmegaConf cause (why an override's value does not fit) if any."""
    text = str(exc).split("Config search path:")[0]
    cause = exc.__cause__
    if cause is not None:
        text += " (" + (getattr(cause, "msg", None) or str(cause)).splitlines()[0] + ")"
    return one_line(text)


@contextmanager
def user_errors(label: str = "error", traces: bool | None = None,
                kinds: tuple[type[BaseException], ...] = USER_ERRORS) -> Iterator[None]:
    """The CLI boundary: an exception of `kinds` inside becomes `label: <message>` on one
    line of stderr and exit code 2; anything else propagates with its traceback.
    traces: keep the traceback of user errors too (default: HYDRA_FULL_ERROR=1)."""
    try:
        yield
    except kinds as exc:
        if full_traces() if traces is None else traces:
            raise
        exit_user_error(exc, label)


def run_cli(config_name: str, schema: type, fn: Callable[[Any], Any]) -> None:
    """Entry point body for `python -m <stage>`: compose from argv overrides, validate, run
    `fn(config)`, reporting user errors as one line and exit 2 (module docstring)."""
    import hydra
    from hydra.errors import CompactHydraException

    register_schema(config_name, schema)
    traces = full_traces()

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _main(cfg) -> None:
        # TypeError too: here it is a __post_init__ type check of a value the user gave.
        with user_errors("config error", traces, kinds=(ValueError, TypeError)):
            config = to_config(cfg)
        with user_errors("error", traces):
            fn(config)

    if traces:
        _main()
        return
    # Hydra prints its own errors (an unknown preset, a malformed override) with a footer and
    # exits 1; with its full-error switch on it raises them to us instead. A bug in `fn` then
    # propagates with its complete traceback.
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        _main()
    except CompactHydraException as exc:
        exit_user_error(hydra_message(exc), "config error")
    finally:
        os.environ.pop(FULL_ERROR_ENV, None)
