"""``python -m services.prefill``: a prefill worker (config, wiring, signals)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid

from tandem.v1 import worker_pb2_grpc

from services.common.admission import TokenLedger
from services.common.engine_metrics import observe_engine
from services.common.grpc_server import start_server
from services.common.kv_setup import prefill_side
from services.common.metrics import AdmissionCollector, KVPathCollector
from services.common.observability import Observability
from services.common.security import apply as apply_security
from services.common.worker import (
    WorkerConfig,
    add_worker_flags,
    advertised,
    drain,
    pending_limit,
    register,
    run_until_signal,
    setup_logging,
    start_engine,
    worker_config,
)
from services.prefill.core import PrefillCore
from services.prefill.server import KVTransportServicer, PrefillServicer

log = logging.getLogger("tandem.prefill")


def parse_config(argv: list[str] | None = None) -> WorkerConfig:
    """The frozen config from flags, falling back to TANDEM_* environment variables."""
    parser = argparse.ArgumentParser(prog="tandem prefill", description=__doc__)
    add_worker_flags(parser)
    return worker_config("prefill", parser.parse_args(argv))


async def serve(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    apply_security(config.security)  # before any etcd connection
    obs = Observability.start(config.observability, "prefill", config.model_name, config.worker_id)
    incarnation = uuid.uuid4().hex
    engine = start_engine(config)
    observe_engine(engine.engine, obs.metrics.registry)
    ledger = TokenLedger(
        pending_limit(config, engine.engine),
        config.batch_admission_fraction,
        name=f"prefill worker {config.worker_id}",
    )
    core = PrefillCore(engine, config.worker_id, incarnation, config.lease_seconds, ledger)
    obs.metrics.register(AdmissionCollector(ledger))
    server = await start_server(
        [
            (worker_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(core)),
            (worker_pb2_grpc.add_KVTransportServicer_to_server, KVTransportServicer(core)),
        ],
        ["tandem.v1.Prefill", "tandem.v1.KVTransport"],
        config.bind,
        metrics=obs.grpc,
        tls=config.security.tls,
    )
    core.address = advertised(config, server.port)
    core.start()
    kv = await prefill_side(
        config.kv_transport,
        engine.engine,
        config.worker_id,
        incarnation,
        config.etcd,
        core,
        config.cuda_ipc,
    )
    reg = await register(config, core.address, engine.engine, incarnation, kv.extra)
    if reg is not None:
        kv.publish = reg.registration.set_extra
    obs.metrics.register(KVPathCollector(kv))
    log.info("prefill worker %s listening on %s", config.worker_id, core.address)
    print(f"READY prefill {core.address}", flush=True)

    def busy() -> int:  # prefills in flight, and finished ones whose KV decode has not pulled
        return len(core.ledger.inflight) + core.num_held

    async def cleanup() -> None:
        core.ledger.close()  # new prefills get UNAVAILABLE: the router retries them elsewhere
        await drain(server, reg.registration if reg else None, busy, config.drain_timeout)
        if reg is not None:
            await reg.stop()
        await server.stop(grace=5)
        await kv.close()
        await core.stop()
        engine.stop()
        obs.stop()

    await run_until_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    setup_logging("prefill")
    asyncio.run(serve(argv))


if __name__ == "__main__":
    main()
