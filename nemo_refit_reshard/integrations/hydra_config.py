"""A Hydra config with command-line overrides, every config error one line.

``load_config(dir, name, overrides)`` composes the YAML and the ``key=value`` overrides
with Hydra's compose API (the same override grammar as ``@hydra.main``, without its
output directories) and turns Hydra's and OmegaConf's errors into a
:class:`ConfigError` whose message is one line naming the key, the value and the
choices. ``configure_or_exit(build)`` runs a command's configuration step and prints
such errors — and the ``ValueError``s our config classes raise, which name key, value
and choices too — as ``error: ...`` on stderr, exiting with status 2, no traceback.
(Only the configuration step: an error while running keeps its traceback.)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config value or override (one line)."""


def _keys_at(config: dict[str, Any], path: list[str]) -> list[str] | None:
    node: Any = config
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return sorted(k for k in node if k != "hydra") if isinstance(node, dict) else None


def _one_line(err: BaseException, base: dict[str, Any], overrides: Sequence[str]) -> str:
    text = str(err)
    key = re.search(r"Could not override '([^']+)'", text) or re.search(r"full_key: ([\w.]+)", text)
    if key:
        name = key.group(1)
        given = next((o for o in overrides if o.split("=", 1)[0].lstrip("+~") == name), name)
        *parent, leaf = name.split(".")
        choices = _keys_at(base, parent)
        where = ".".join(parent) or "the config"
        if choices is not None and leaf not in choices:
            return f"{given}: {where} has no key {leaf!r}; choose one of: {', '.join(choices)}"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return first


def load_config(config_dir: str | Path, name: str, overrides: Sequence[str]) -> dict[str, Any]:
    """The composed config as plain containers; :class:`ConfigError` on a bad override."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    def composed(with_overrides: Sequence[str]) -> dict[str, Any]:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(Path(config_dir).resolve()), version_base=None):
            cfg = compose(name, overrides=list(with_overrides))
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]

    try:
        return composed(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_one_line(err, composed([]), overrides)) from None


def configure_or_exit(build: Callable[[], T]) -> T:
    """``build()``; a config error becomes one ``error:`` line on stderr and exit 2."""
    try:
        return build()
    except ValueError as err:  # ConfigError included
        print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
