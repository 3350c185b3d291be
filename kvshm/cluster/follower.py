"""The view follower: a cluster client's member view, pushed by its local server.

The follower keeps one CLUSTER_VIEW ``{since: my revision, wait: W}`` outstanding on a
connection of its own (:class:`kvshm.AsyncClient`): the server parks it and answers the
moment its view's revision changes (or after ``W`` seconds with nothing new), so a
change reaches every client at once and an idle cluster costs one small round trip per
``W``. A reply with a ``view`` replaces the client's :class:`ViewState` whole: the new
:class:`~kvshm.cluster.placement.Placement` (its bucket table built first, off the
request path) and the time of the change (the fallback window starts there).

The same coroutine (:func:`follow`) runs as a task in the caller's event loop for
:class:`kvshm.AsyncClusterClient`, and in an event loop of its own thread
(:class:`ThreadFollower`) for the synchronous :class:`kvshm.ClusterClient`; closing
either cancels the parked request at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Coroutine

from kvshm.cluster.placement import Placement
from kvshm.cluster.view import View
from kvshm.errors import KvshmError

__all__ = ["ViewState", "follow", "fetch", "ThreadFollower", "DEFAULT_WAIT"]

log = logging.getLogger(__name__)

#: Seconds a CLUSTER_VIEW may stay parked at the server (an idle cluster: one round
#: trip per this long per client).
DEFAULT_WAIT = 10.0

#: (old view, new view) when the member list changed.
OnChange = Callable[[View, View], None]


class ViewState:
    """The view a cluster client uses, and what is derived from it (replaced whole).

    Attributes
    ----------
    view : View
    placement : Placement
        Owners over ``view``'s up members (bucket table built).
    changed_at : float
        ``time.monotonic()`` of the last change of the member list (-inf: none seen
        since the first view).
    local_id : str
        The local server's node id.
    """

    def __init__(self) -> None:
        self.view = View()
        self.placement = Placement(self.view)
        self.changed_at = -1e18
        self.local_id = ""
        self.changes = 0
        self.lock = threading.Lock()

    def apply(self, body: dict[str, Any]) -> tuple[View, View] | None:
        """Take a CLUSTER_VIEW reply; returns (old, new) when the member list changed.

        Raises ValueError on a malformed view (the old one stays)."""
        self.local_id = body.get("node_id", "")
        if "view" not in body:
            fresh = bool(body.get("fresh", True))
            v = self.view
            if fresh != v.fresh:
                self.view = View(v.revision, v.members, v.cluster, fresh)
            return None
        new = View.from_dict(body["view"])
        old = self.view
        if new.same_members(old):
            self.view = new
            return None
        placement = Placement(new).prepare()     # the table before any request uses it
        with self.lock:
            old = self.view
            self.view = new
            self.placement = placement
            if old.revision:
                self.changed_at = time.monotonic()
            self.changes += 1
        return old, new


async def fetch(client: Any, state: ViewState, since: int | None = None,
                wait: float | None = None) -> tuple[View, View] | None:
    """One CLUSTER_VIEW through ``client`` (an :class:`kvshm.AsyncClient`), applied."""
    from kvshm.cluster.cli import op_view

    rev = state.view.revision if since is None else since
    body = await client.run_op(op_view(client.session, rev, wait=wait))
    return state.apply(body)


async def follow(client: Any, state: ViewState, on_change: OnChange, *,
                 wait: float = DEFAULT_WAIT, retry: float = 0.25,
                 on_push: Callable[[], None] | None = None) -> None:
    """Follow the local server's view until cancelled.

    ``client`` is an :class:`kvshm.AsyncClient` of the local server whose ``timeout``
    exceeds ``wait``; ``on_change(old, new)`` runs for every change of the member list;
    ``retry``: seconds between attempts while the server does not answer (the last view
    stays), and the pause after a reply that came back at once with nothing new (a
    server that does not park: the follower then polls).
    """
    while True:
        t0 = time.monotonic()
        rev = state.view.revision
        try:
            changed = await fetch(client, state, rev, wait)
        except asyncio.CancelledError:
            raise
        except (KvshmError, ValueError) as exc:
            log.debug("cluster view from the local server failed: %s", exc)
            await asyncio.sleep(retry)
            continue
        except Exception:        # the follower must outlive a bad reply
            log.exception("cluster view follower step failed")
            await asyncio.sleep(retry)
            continue
        if state.view.revision != rev and on_push is not None:
            on_push()
        if changed is not None:
            try:
                on_change(*changed)
            except Exception:
                log.exception("cluster view change handler failed")
        elif state.view.revision == rev and time.monotonic() - t0 < min(retry, wait / 2):
            await asyncio.sleep(retry)       # answered at once with nothing new


class ThreadFollower:
    """Runs :func:`follow` in an event loop of its own daemon thread (for the
    synchronous client). :meth:`call` runs a coroutine there and waits for it."""

    def __init__(self, make_client: Callable[[], Any], name: str = "kvshm-cluster-view"
                 ) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._make_client = make_client
        self.client: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()
        try:
            pending = asyncio.all_tasks(self._loop)
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending,
                                                             return_exceptions=True))
            if self.client is not None:
                self._loop.run_until_complete(self.client.close())
        finally:
            self._loop.close()

    def call(self, coro_fn: Callable[[], Coroutine[Any, Any, Any]],
             timeout: float | None = None) -> Any:
        """Run ``coro_fn()`` on the follower's loop; its result (or exception)."""
        async def run() -> Any:
            if self.client is None:
                self.client = self._make_client()
            return await coro_fn()

        fut: Future[Any] = asyncio.run_coroutine_threadsafe(run(), self._loop)
        return fut.result(timeout)

    def start(self, coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start ``coro_fn()`` as the follower task."""
        def go() -> None:
            self._task = self._loop.create_task(coro_fn())
        self._loop.call_soon_threadsafe(go)

    def stop(self) -> None:
        """Cancel the follower (its parked request too), close its client, end the
        thread. Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
