"""An in-process stand-in for Flower's simulation engine, for tests (style principle 7: one
narrow interface, an in-process implementation for tests).

`run_in_process(server_app, client_app, num_supernodes)` runs the very same ServerApp (and so
the strategy's `start`, Flower's round loop) and ClientApp, but delivers each message by calling
the ClientApp in this process instead of a Ray worker: no Ray start-up, so a test runs a few
rounds in seconds. As in Flower, node i gets `partition-id` i, an exception in the ClientApp
becomes an error reply, and a Context per node persists across messages.

`ftis run` always uses Flower's simulation engine (`ftis.algos.federated.launch`); this engine
is passed to `run_federated(..., engine=run_in_process)` (and FedDPO's `run_fed_dpo`) by tests
only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

SERVER_NODE_ID = 1  # Flower's SuperLink node id: the sender of instruction messages
CLIENT_APP_ERROR = 2  # Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process (node ids 1001, 1002, ...)."""

    def __init__(self, client_app: ClientApp, num_nodes: int) -> None:
        self.client_app = client_app
        self.contexts = {
            1001 + i: Context(
                run_id=0,
                node_id=1001 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return getattr(self, "_run", None)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg_id = str(uuid4())
            msg.metadata.__dict__["_message_id"] = msg_id
            context = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.client_app(msg, context)
            except Exception as e:  # Flower turns a ClientApp exception into an error reply
                reply = Message(
                    Error(code=CLIENT_APP_ERROR, reason=f"{type(e).__name__}: {e}"),
                    reply_to=msg,
                )
            self._replies[msg_id] = reply
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def run_in_process(
    server_app: ServerApp, client_app: ClientApp, num_supernodes: int, **_: Any
) -> None:
    """Run `server_app` against `num_supernodes` in-process nodes running `client_app`."""
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 0
    TaskIdentity.node_id = SERVER_NODE_ID
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    server_app(InProcessGrid(client_app, num_supernodes), context)
