"""Weight sync from trainer rank 0 to the engines: one interface (base.py), one file per transport.

from clawrl.weight_sync import make_sender, verify_engine_weights
"""

from clawrl.weight_sync.base import WeightSender, WeightSyncError, make_sender, transport_for
from clawrl.weight_sync.checksum import WeightMismatchError, tensor_checksum, verify_engine_weights

__all__ = [
    "WeightMismatchError",
    "WeightSender",
    "WeightSyncError",
    "make_sender",
    "tensor_checksum",
    "transport_for",
    "verify_engine_weights",
]
