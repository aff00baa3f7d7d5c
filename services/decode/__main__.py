"""``python -m services.decode``: a decode worker (config, wiring, signals)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid

from tandem.v1 import worker_pb2_grpc

from services.common.admission import TokenLedger
from services.common.engine_metrics import observe_engine
from services.common.grpc_server import start_server
from services.common.kv_observe import ObservedTransport
from services.common.kv_setup import decode_side
from services.common.metrics import (
    AdmissionCollector,
    HandoffCollector,
    KVPathCollector,
    KVTransferMetrics,
)
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
from services.decode.core import DecodeCore
from services.decode.server import DecodeServicer

log = logging.getLogger("tandem.decode")


def parse_config(argv: list[str] | None = None) -> WorkerConfig:
    """The frozen config from flags, falling back to TANDEM_* environment variables."""
    parser = argparse.ArgumentParser(prog="tandem decode", description=__doc__)
    add_worker_flags(parser)
    return worker_config("decode", parser.parse_args(argv))


async def serve(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    apply_security(config.security)  # before any etcd connection
    obs = Observability.start(config.observability, "decode", config.model_name, config.worker_id)
    incarnation = uuid.uuid4().hex
    engine = start_engine(config)
    observe_engine(engine.engine, obs.metrics.registry)
    kv = await decode_side(
        config.kv_transport,
        config.nixl_mode,
        engine.engine,
        config.worker_id,
        incarnation,
        config.etcd,
        config.security.tls,
        config.cuda_ipc,
    )
    assert kv.transport is not None
    core = DecodeCore(
        engine,
        ObservedTransport(kv.transport, KVTransferMetrics.create(obs.metrics.registry)),
        config.worker_id,
        incarnation,
        transfer_timeout=config.kv_transfer_timeout,
        on_transfer_failure=config.on_transfer_failure,
        ledger=TokenLedger(
            pending_limit(config, engine.engine),
            config.batch_admission_fraction,
            name=f"decode worker {config.worker_id}",
        ),
    )
    obs.metrics.register(AdmissionCollector(core.ledger))
    obs.metrics.register(HandoffCollector(core))
    server = await start_server(
        [(worker_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(core))],
        ["tandem.v1.Decode"],
        config.bind,
        metrics=obs.grpc,
        tls=config.security.tls,
    )
    address = advertised(config, server.port)
    reg = await register(config, address, engine.engine, incarnation, kv.extra)
    if reg is not None:
        kv.publish = reg.registration.set_extra
    obs.metrics.register(KVPathCollector(kv))
    log.info("decode worker %s listening on %s", config.worker_id, address)
    print(f"READY decode {address}", flush=True)

    async def cleanup() -> None:
        core.ledger.close()  # new requests get UNAVAILABLE: the router retries them elsewhere
        # Running streams finish (up to the drain timeout); aborts still reach them.
        registration = reg.registration if reg else None
        await drain(server, registration, lambda: len(core.ledger.inflight), config.drain_timeout)
        if reg is not None:
            await reg.stop()
        await server.stop(grace=5)
        await kv.close()
        engine.stop()
        obs.stop()

    await run_until_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    setup_logging("decode")
    asyncio.run(serve(argv))


if __name__ == "__main__":
    main()
