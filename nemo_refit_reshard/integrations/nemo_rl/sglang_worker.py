"""NeMo RL's SGLang server actor, started with our refit loader registered.

NeMo RL's ``SGLangGenerationWorker._compute_server_args`` forwards a fixed list of
``sglang_cfg`` keys to SGLang's ``ServerArgs``; ``custom_weight_loader`` is not among
them, so no config key can register our loader (``integrations/sglang/loader.py``).
:class:`ReshardSGLangGenerationWorker` is NeMo RL's worker with that one argument added,
and the two calls of SGLang's weight-update session NeMo RL's worker lacks.
:func:`install_sglang_worker`, before GRPO's ``setup``, makes NeMo RL's
``SGLangGeneration`` start it: ``_start_engines`` reads the worker class from its
module's global, on the driver.

The actor still runs in NeMo RL's SGLang venv (``make_actor_runtime_env`` is keyed by
NeMo RL's own worker name), which must hold this package too: SGLang imports the loader
by name in every scheduler process.
"""

from __future__ import annotations

from typing import Any

import ray
import requests
from nemo_rl.models.generation.sglang import sglang_generation
from nemo_rl.models.generation.sglang.sglang_worker import SGLangGenerationWorker

from ..sglang.loader import LOADER

_NemoRlWorker: Any = SGLangGenerationWorker.__ray_actor_class__  # the class under ray.remote


class ReshardSGLangGenerationWorker(_NemoRlWorker):  # type: ignore[misc, valid-type]
    """NeMo RL's SGLang server actor with ``custom_weight_loader`` including |LOADER|."""

    def _compute_server_args(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        server_args = dict(super()._compute_server_args(*args, **kwargs))
        loaders = list(server_args.get("custom_weight_loader") or [])
        server_args["custom_weight_loader"] = loaders + [LOADER] * (LOADER not in loaders)
        return server_args

    def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session, inside which SGLang (since sgl-project/
        sglang#28001) accepts ``update_weights_from_tensor``. False: the server has no
        such endpoint (an SGLang from before the session, e.g. NeMo RL's pinned
        0.5.12.post1, which takes updates without one)."""
        return self._weight_update_session("begin_weight_update")

    def end_weight_update(self) -> bool:
        """Close the session :meth:`begin_weight_update` opened."""
        return self._weight_update_session("end_weight_update")

    def _weight_update_session(self, endpoint: str) -> bool:
        if self.node_rank != 0:  # only the first node's server takes requests
            return True
        response = requests.post(f"{self.server_base_url}/{endpoint}", json={})
        if response.status_code == 404:
            return False
        try:
            response.raise_for_status()
        except requests.exceptions.HTTPError as err:
            err.add_note(f"{response.text=}")
            raise
        return True


def install_sglang_worker() -> None:
    """Make NeMo RL's ``SGLangGeneration`` start :class:`ReshardSGLangGenerationWorker`
    (call on the driver before GRPO's ``setup``)."""
    sglang_generation.SGLangGenerationWorker = ray.remote(ReshardSGLangGenerationWorker)
