"""The colocated node: one LLMEngine that prefills and decodes (node loop: node/runtime.py).

Inbound: Generate -> `Generation.admit` (a bad request fails alone with RequestFailed 400);
Abort -> `Generation.abort` (unknown ids ignored). Each iteration: one engine step, whose
outputs go to the router as one TokenBatch (node/generation.py says what a failed step does).
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.config import NodeConfig
from pdserve.node.generation import Generation
from pdserve.node.runtime import NodeRuntime
from pdserve.wire.messages import Abort, Generate
from pdserve.wire.node_stats import TokenTotals
from pdserve.wire.roles import Role


class ColocatedNode(NodeRuntime):
    role = Role.COLOCATED

    def __init__(self, *, engine_config: EngineConfig, config: NodeConfig) -> None:
        engine = LLMEngine(engine_config)
        super().__init__(engine=engine, config=config)
        self.generation = Generation(engine, config.node_id)

    def handle(self, message: Any) -> None:
        if isinstance(message, Generate):
            refusal = self.generation.admit(message)
            if refusal is not None:
                self.send(refusal)
        elif isinstance(message, Abort):
            self.generation.abort(message.request_id)
        else:
            super().handle(message)

    def work(self) -> None:
        for message in self.generation.step():
            self.send(message)

    def token_totals(self) -> TokenTotals:
        return self.generation.token_totals()
