"""With ``run_torch_fsdp2_tests.sh --backend-collectives`` (this folder on PYTHONPATH), fsdp_lite
all-gathers and reduce-scatters with the backend's own collectives on gloo too, instead of the
point-to-point sends it picks there (``collectives.Transport.choose``; the same bytes and, at the
sizes it uses them, the same results). torch's ``CommDebugMode`` counts collectives, not sends:
tests that count them can then run switched. Natively nothing changes (fsdp_lite is not used)."""

import fsdp_lite.engine.collectives as _collectives


def _backend(group, device):
    return _collectives.BACKEND


_collectives.Transport.choose = staticmethod(_backend)
