"""Stand-ins for the private helpers of torch's FSDP1 that torch's test utilities call on the
wrapper; imported by the switched test files only (scripts/switch_torch_fsdp1_tests.py's
bindings). No test code of torch's; nothing here touches numbers a test compares.

* ``FullyShardedDataParallel._assert_state(state)``: torch's ``FSDPTest._train_for_several_steps``
  (``common_fsdp``) ends with ``model._assert_state(TrainingState.IDLE)`` on the FSDP model, a
  private method of torch's class that checks the wrapper's training state. Here it checks the same
  thing on fsdp_lite's wrapper, its unit's training state (fsdp_lite/engine/unit.py
  ``TrainingState``), with torch's states mapped to fsdp_lite's: ``IDLE`` -> ``IDLE``,
  ``FORWARD_BACKWARD`` -> ``FORWARD`` or ``BACKWARD``, ``SUMMON_FULL_PARAMS`` -> ``SUMMON``; and
  raises torch's ``ValueError`` when it does not hold. Without it the switched run stops on an
  ``AttributeError`` before the test's loss and parameter comparisons with DDP.
"""

from __future__ import annotations

from torch.distributed.fsdp._common_utils import TrainingState as _TorchTrainingState

import fsdp_lite
from fsdp_lite.engine.unit import TrainingState as _LiteTrainingState

_STATES = {
    _TorchTrainingState.IDLE: (_LiteTrainingState.IDLE,),
    _TorchTrainingState.FORWARD_BACKWARD: (
        _LiteTrainingState.FORWARD,
        _LiteTrainingState.BACKWARD,
    ),
    _TorchTrainingState.SUMMON_FULL_PARAMS: (_LiteTrainingState.SUMMON,),
}


def _assert_state(self, state) -> None:
    """torch FSDP1's ``_assert_state``, read from fsdp_lite's unit."""
    states = [state] if isinstance(state, _TorchTrainingState) else list(state)
    allowed = tuple(s for t in states for s in _STATES[t])
    current = self._unit.training_state
    if current not in allowed:
        raise ValueError(
            f"expected to be in states {states} but current state is {current} (fsdp_lite's unit)"
        )


if not hasattr(fsdp_lite.FullyShardedDataParallel, "_assert_state"):
    fsdp_lite.FullyShardedDataParallel._assert_state = _assert_state
