"""The link to one encoder actor, chosen once when the actor joins: the same-node channel (with
the Ray call behind it) where the actor serves one on this node, else the Ray call."""

from __future__ import annotations

from typing import Any

from vitpool.transport.channel_client import ChannelClient
from vitpool.transport.channel_link import ChannelLink
from vitpool.transport.channel_protocol import ChannelInfo, channel_supported
from vitpool.transport.link import ActorLink
from vitpool.transport.ray_link import RayLink


def make_link(
    handle: Any,
    channel_info: ChannelInfo | None,
    reply_timeout_s: float | None,
    spin_s: float,
    name: str = "the encoder actor",
) -> ActorLink:
    """The link to an actor.

    Args:
        handle: the actor's Ray handle.
        channel_info: the actor's channel if the caller may use it (the actor serves one, on the
            caller's node, and the settings allow it); None: Ray calls only.
        reply_timeout_s: how long a channel reply may take before the connection counts as
            broken (then the batch goes through Ray); None: no limit.
        spin_s: how long a wait for a channel reply polls before it sleeps (`ChannelClient`).
        name: the actor in messages, e.g. "encoder actor 3".
    """
    ray_link = RayLink(handle, name)
    if channel_info is None or not channel_supported():
        return ray_link
    return ChannelLink(ChannelClient(channel_info, reply_timeout_s, spin_s), ray_link, name)
