"""``llmserve serve --data-parallel-size N``: N engine replicas as Ray actors, one endpoint.

    HTTP handler -> DataParallelEngine.add_request -> PrefixRouter.choose (server process)
        -> ReplicaActor.generate (Ray actor: AsyncLLMEngine + LLMEngine, its own KV cache)
        -> outputs streamed back through Ray -> the request's RequestStream -> client

``DataParallelEngine`` has the interface of ``AsyncLLMEngine`` that the server uses, so the
serving layers do not know how many engines answer. A health poll (every ``POLL_S``) copies
each replica's counters for /metrics; a replica found dead fails its in-flight requests with
``ReplicaDiedError`` (503, Retry-After), is replaced by a fresh actor, and takes requests
again once that one has loaded the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from llmserve.config import EngineConfig
from llmserve.distributed.plan import make_plan
from llmserve.distributed.replica import Replica, ReplicaActor, connect_ray
from llmserve.distributed.router import PrefixRouter
from llmserve.engine.async_engine import (
    EngineClosedError,
    EngineListeners,
    EngineSnapshot,
    RequestStream,
    stream_outputs,
)
from llmserve.engine.async_engine import ReplicaDiedError as ReplicaDiedError
from llmserve.engine.frontend import EngineFrontend
from llmserve.engine.llm_engine import prompt_cache_salt
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 1.0  # health and metrics poll of the replicas
POLL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0


class DataParallelEngine:
    """``AsyncLLMEngine``'s server-facing interface over N Ray replicas."""

    def __init__(self, config: EngineConfig, max_num_waiting: int | None = None) -> None:
        parallel = config.parallel
        self.engine = EngineFrontend.load(config)  # a bad model path fails here, before Ray
        if parallel.tensor_parallel_size > 1:  # so does a split the replicas would refuse
            make_plan(self.engine.hf_config, parallel.tensor_parallel_size)
        self.ray = connect_ray(parallel.ray_address)
        self.config = config
        self.max_num_waiting = max_num_waiting
        self.listeners = EngineListeners()
        self.snapshot = EngineSnapshot()
        self.router = PrefixRouter(parallel.data_parallel_size, config.cache.block_size)
        self.replicas = [Replica(i) for i in range(parallel.data_parallel_size)]
        self._requests: dict[str, tuple[Replica, asyncio.Task]] = {}
        self._is_accepting = True
        self._poll_task: asyncio.Task | None = None
        self._check_resources()
        for replica in self.replicas:
            self._launch(replica)
        try:
            described = self.ray.get([r.actor.describe.remote() for r in self.replicas])
        except self.ray.exceptions.RayActorError as e:
            self.stop()
            raise RuntimeError(f"a data-parallel replica failed to start: {e}") from None
        for replica, info in zip(self.replicas, described):
            replica.pid, replica.is_healthy = info["pid"], True
        first = described[0]
        self.engine.model_name = first["model_name"]
        self.engine.max_model_len = first["max_model_len"]
        self.engine.kv_info = f"{len(self.replicas)} replicas, each: {first['kv_info']}"

    # ---- replicas -----------------------------------------------------------------------
    def _replica_kwargs(self) -> dict[str, Any]:
        kwargs = {}
        for part in ("model", "cache", "scheduler", "device", "parallel"):
            kwargs |= dataclasses.asdict(getattr(self.config, part))
        kwargs |= {"data_parallel_size": 1, "distributed_executor_backend": None}
        return kwargs | {"ray_address": None}

    def _resources(self) -> dict[str, float]:
        tp = self.config.parallel.tensor_parallel_size
        uses_gpu = self.config.device.device == "cuda" or (
            self.config.device.device == "auto" and self.ray.cluster_resources().get("GPU", 0) > 0
        )
        return {"num_cpus": 0 if uses_gpu else tp, "num_gpus": tp if uses_gpu else 0}

    def _check_resources(self) -> None:
        """More replicas than the cluster has devices for: refuse now, not hang pending."""
        need, have = self._resources(), self.ray.cluster_resources()
        n = len(self.replicas)
        for key, what in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            if need[key] and need[key] * n > have.get(what, 0):
                raise ValueError(
                    f"--data-parallel-size {n} x --tensor-parallel-size "
                    f"{self.config.parallel.tensor_parallel_size} needs {need[key] * n:g} {what}s "
                    f"but the Ray cluster has {have.get(what, 0):g}"
                )

    def _launch(self, replica: Replica) -> None:
        actor_class = self.ray.remote(ReplicaActor)
        options = self._resources() | {"max_restarts": 0, "max_concurrency": 1000}
        replica.actor = actor_class.options(**options).remote(
            self._replica_kwargs(), self.max_num_waiting
        )

    async def _restart(self, replica: Replica) -> None:
        """Replace a dead replica's actor; it takes requests again once loaded."""
        if not replica.is_healthy:
            return
        replica.is_healthy = False
        replica.num_restarts += 1
        self.router.forget(replica.index)
        logger.warning("replica %d (pid %s) died; starting a new one", replica.index, replica.pid)
        self.ray.kill(replica.actor, no_restart=True)
        while self._is_accepting:
            self._launch(replica)
            try:
                info = await replica.actor.describe.remote()
            except Exception:
                logger.exception("replica %d failed to restart; trying again", replica.index)
                await asyncio.sleep(POLL_S)
                continue
            replica.pid, replica.is_healthy = info["pid"], True
            logger.info("replica %d is back (pid %d)", replica.index, replica.pid)
            return

    # ---- lifecycle (the server's lifespan) ---------------------------------------------
    def start(self) -> None:
        self._poll_task = asyncio.get_running_loop().create_task(self._poll())

    def begin_shutdown(self) -> None:
        self._is_accepting = False
        for request_id in list(self._requests):
            self.abort(request_id)

    def stop(self, timeout: float = 10.0) -> None:
        self.begin_shutdown()
        if self._poll_task is not None:
            self._poll_task.get_loop().call_soon_threadsafe(self._poll_task.cancel)
        for replica in self.replicas:
            self.ray.kill(replica.actor, no_restart=True)

    @property
    def is_alive(self) -> bool:
        return self._is_accepting and any(r.is_healthy for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas if r.is_healthy)

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(r) for r in self.replicas if r.is_healthy))
            self.snapshot = _sum_snapshots([r.snapshot for r in self.replicas])
            await asyncio.sleep(POLL_S)

    async def _poll_one(self, replica: Replica) -> None:
        try:
            snapshot = replica.actor.snapshot.remote()
            replica.snapshot, replica.num_waiting = await asyncio.wait_for(snapshot, POLL_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("replica %d did not answer the health poll in time", replica.index)
        except self.ray.exceptions.RayActorError:
            asyncio.get_running_loop().create_task(self._restart(replica))

    # ---- requests -----------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt, params: SamplingParams, priority: int = 0, lora_request=None
    ) -> RequestStream:
        """Route, then queue on that replica; raises what the replica's engine raises."""
        if lora_request is not None:  # EngineConfig refuses --enable-lora with replicas
            raise ValueError("LoRA adapters are not served by data-parallel replicas")
        if not self._is_accepting:
            raise EngineClosedError("the server is shutting down and takes no new requests")
        healthy = [r.index for r in self.replicas if r.is_healthy]
        if not healthy:
            raise ReplicaDiedError("no replica is running (they are restarting); retry shortly")
        text, token_ids = self.engine.prompt_token_ids(prompt)
        salt = prompt_cache_salt(prompt)
        replica = self.replicas[self.router.choose(token_ids, healthy, salt)]
        prompt = {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": salt}
        stream = RequestStream(request_id)
        try:
            outputs = replica.actor.generate.options(num_returns="streaming").remote(
                request_id, prompt, params, priority
            )
            await self._unwrap(replica, _next(outputs))
        except BaseException:
            self.router.done(replica.index)
            replica.actor.abort.remote(request_id)  # admitted, maybe, before the caller left
            raise
        task = asyncio.get_running_loop().create_task(self._pump(replica, outputs, stream))
        self._requests[request_id] = (replica, task)
        return stream

    def generate(
        self, request_id: str, prompt, params: SamplingParams, priority: int = 0, lora_request=None
    ):
        return stream_outputs(self, request_id, prompt, params, priority, lora_request)

    def abort(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            entry[0].actor.abort.remote(request_id)

    async def _unwrap(self, replica: Replica, result: Awaitable) -> Any:
        """A replica's result, its engine's exception, or ReplicaDiedError if it died."""
        ray_errors = self.ray.exceptions
        try:
            return await result
        except ray_errors.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))) from None
        except (ray_errors.RayActorError, ray_errors.ObjectLostError) as e:
            asyncio.get_running_loop().create_task(self._restart(replica))
            raise ReplicaDiedError(
                f"data-parallel replica {replica.index} died while serving this request; "
                "it is being restarted, retry"
            ) from e

    async def _pump(self, replica: Replica, outputs: AsyncIterator, stream: RequestStream) -> None:
        """Copy the replica's outputs into the request's stream until it finishes or fails."""
        try:
            while True:
                output: RequestOutput = await self._unwrap(replica, _next(outputs))
                stream.put(output)
                if output.finished:
                    self.listeners.notify_finish(output)
        except StopAsyncIteration:
            pass
        except Exception as e:
            stream.put(e)
        finally:
            self.router.done(replica.index)
            self._requests.pop(stream.request_id, None)

    def replica_metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """(kind, name, help, labels, value) rows for /metrics, one set per replica."""
        rows = []
        for r in self.replicas:
            labels = {"replica": str(r.index), "pid": str(r.pid)}
            rows += [
                ("gauge", "replica_up", "1 while the replica serves", labels, float(r.is_healthy)),
                ("gauge", "replica_requests_in_flight", "Requests routed to the replica and not finished", {"replica": str(r.index)}, self.router.in_flight[r.index]),
                ("counter", "replica_requests_routed", "Requests routed to the replica", {"replica": str(r.index)}, self.router.num_routed[r.index]),
                ("counter", "replica_restarts", "Times the replica was replaced", {"replica": str(r.index)}, r.num_restarts),
            ]  # fmt: skip
        return rows


async def _next(outputs: AsyncIterator) -> Any:
    """The next item of a Ray streaming call (StopAsyncIteration at its end)."""
    return await (await outputs.__anext__())


def _sum_snapshots(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """Counters and gauges over replicas: sums; KV usage the mean; the batch maximum the max."""
    summed = {
        f.name: sum(getattr(s, f.name) for s in snapshots)
        for f in dataclasses.fields(EngineSnapshot)
        if f.name not in ("kv_cache_usage", "max_batched_seqs", "spec_decode")
    }
    return EngineSnapshot(
        **summed,
        kv_cache_usage=sum(s.kv_cache_usage for s in snapshots) / max(len(snapshots), 1),
        max_batched_seqs=max((s.max_batched_seqs for s in snapshots), default=0),
    )
