"""The Ray actor: owns one GraphEncoder on one GPU, serves batches (through Ray or the same-node
channel), reports health and stats."""

from vitpool.actors.encoder_actor import EncoderActor
from vitpool.actors.reports import OK, RETIRED, ActorInfo, ActorStats, BatchReceipt

__all__ = ["OK", "RETIRED", "ActorInfo", "ActorStats", "BatchReceipt", "EncoderActor"]
