"""Transport security without the model: a gRPC server with mutual TLS (as every service starts
it), the gateway over HTTPS, and a real etcd that requires client certificates, reached through
the registry with ``--etcd-ca/--etcd-cert/--etcd-key``. Certificates are made on the fly."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import grpc
import httpx
import pytest
from aetcd import rpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.bundled import DEFAULT_DIR
from engine.tokenizer import Tokenizer
from libkv.cluster.registry import Member, MemberWatcher, Registration
from services.common import security
from services.common.grpc_server import start_server
from services.common.security import EtcdSecurity, Security
from services.common.tls import TLSFiles, channel
from services.gateway.server import create_app
from services.launcher.etcd import EtcdServer, EtcdTLS
from tests.app_server import serving
from tests.services.test_gateway import CONFIG, KEY, FakeBackend
from tests.tls_certs import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TLSFiles]:
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(folder / "ca"), TestCA(folder / "rogue", "rogue-ca")
    out = {}
    for name in ("server", "client"):
        f = ca.issue(name)
        out[name] = TLSFiles(f.cert, f.key, f.ca)
    f = rogue.issue("intruder")  # a valid certificate, but from a CA the server does not trust
    out["rogue"] = TLSFiles(f.cert, f.key, str(ca.ca_path))
    return out


@pytest.fixture
async def tls_server(pki) -> AsyncIterator[str]:
    handle = await start_server([], [], "127.0.0.1:0", tls=pki["server"])
    yield handle.address
    await handle.stop(None)


async def check(ch: grpc.aio.Channel) -> int:
    async with ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        return resp.status


async def test_mutual_tls_admits_only_clients_with_a_certificate_of_our_ca(pki, tls_server):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await check(channel(tls_server, pki["client"])) == serving
    refused = [
        grpc.aio.insecure_channel(tls_server),  # plaintext
        grpc.aio.secure_channel(  # TLS, but no client certificate
            tls_server, grpc.ssl_channel_credentials(Path(pki["client"].ca).read_bytes())
        ),
        channel(tls_server, pki["rogue"]),  # a certificate from another CA
    ]
    for ch in refused:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await check(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# --- the gateway over HTTPS ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def https_gateway(pki) -> Iterator[str]:
    tok = Tokenizer(DEFAULT_DIR)
    app = create_app(CONFIG, FakeBackend(tok), tok)
    s = pki["server"]
    with serving(app, ssl_certfile=s.cert, ssl_keyfile=s.key) as port:
        yield f"127.0.0.1:{port}"


def test_gateway_serves_https_only(pki, https_gateway):
    body = {"model": CONFIG.served_model_name, "prompt": "Hi", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"https://{https_gateway}/v1/completions", json=body, headers=auth,
                   verify=ssl.create_default_context(cafile=pki["server"].ca),
                   timeout=10)  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://{https_gateway}/v1/completions", json=body, headers=auth, timeout=5)


def test_gateway_parses_https_and_mtls_flags(pki) -> None:
    from services.gateway.__main__ import parse_config

    s = pki["server"]
    argv = ["--model-dir", str(DEFAULT_DIR), "--router", "127.0.0.1:1",
            "--ssl-certfile", s.cert, "--ssl-keyfile", s.key]  # fmt: skip
    env = {"TANDEM_TLS_CERT": s.cert, "TANDEM_TLS_KEY": s.key, "TANDEM_TLS_CA": s.ca}
    cfg = parse_config(argv, env=env)
    assert cfg.ssl_certfile == s.cert and cfg.tls == TLSFiles(s.cert, s.key, s.ca)
    with pytest.raises(SystemExit):  # half a TLS configuration is an error, not plaintext
        parse_config(argv, env={"TANDEM_TLS_CERT": s.cert})


# --- etcd with client certificates ---------------------------------------------------------------


@pytest.fixture
def tls_etcd(pki, tmp_path) -> Iterator[EtcdServer]:
    s = pki["server"]
    with EtcdServer(tmp_path / "etcd", tls=EtcdTLS(s.cert, s.key, s.ca)) as etcd:
        yield etcd
    security.apply(Security())  # back to plaintext clients for the rest of the session


async def test_registry_over_etcd_tls_with_client_certificates(pki, tls_etcd):
    host, port = tls_etcd.endpoint.split(":")
    with pytest.raises(Exception):  # noqa: B017, PT011 - plaintext gets no answer
        async with aetcd.Client(host=host, port=int(port), timeout=2) as plain:
            await asyncio.wait_for(plain.get(b"/x"), 3)
    c = pki["client"]
    security.apply(Security(etcd_ca=c.ca, etcd_cert=c.cert, etcd_key=c.key))
    member = Member("decode-tls", "decode", "m", "127.0.0.1:1")
    reg = await Registration.start([tls_etcd.endpoint], member, ttl=5, refresh=1)
    watcher = await MemberWatcher.start([tls_etcd.endpoint])
    try:
        assert reg.registered
        assert await watcher.wait_for(lambda ms: "decode-tls" in ms, 5)
    finally:
        await watcher.stop()
        await reg.stop()


def test_every_service_binds_loopback_unless_told(tmp_path) -> None:
    from services.decode.__main__ import parse_config as decode_config
    from services.gateway.__main__ import parse_config as gateway_config
    from services.prefill.__main__ import parse_config as prefill_config
    from services.router.__main__ import parse_config as router_config

    model = ["--model-dir", str(DEFAULT_DIR)]
    gw = gateway_config([*model, "--router", "127.0.0.1:1"], env={})
    assert (gw.host, gw.observability.metrics_host) == ("127.0.0.1", "127.0.0.1")
    router = router_config([*model, "--etcd", "127.0.0.1:2379"])
    assert (router.host, router.observability.metrics_host) == ("127.0.0.1", "127.0.0.1")
    for parse in (prefill_config, decode_config):
        worker = parse(model)
        assert (worker.host, worker.observability.metrics_host) == ("127.0.0.1", "127.0.0.1")
        assert worker.security.tls is None and worker.security.etcd is None


async def _enable_etcd_auth(endpoint: str, password: str) -> None:
    """etcd's own authentication on: a root user with the root role (what etcdctl does)."""
    async with grpc.aio.insecure_channel(endpoint) as ch:
        auth = rpc.AuthStub(ch)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


async def test_registry_with_etcd_user_and_password(tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd:
        await _enable_etcd_auth(etcd.endpoint, "s3cret")
        host, port = etcd.endpoint.split(":")
        with pytest.raises(Exception):  # noqa: B017, PT011 - no credentials: refused
            async with aetcd.Client(host=host, port=int(port), timeout=2) as anonymous:
                await anonymous.put(b"/x", b"1")
        security.apply(Security(etcd_user="root", etcd_password="s3cret"))
        try:
            member = Member("decode-auth", "decode", "m", "127.0.0.1:1")
            reg = await Registration.start([etcd.endpoint], member, ttl=5, refresh=1)
            watcher = await MemberWatcher.start([etcd.endpoint])
            assert reg.registered
            assert await watcher.wait_for(lambda ms: "decode-auth" in ms, 5)
            await watcher.stop()
            await reg.stop()
        finally:
            security.apply(Security())
    assert "s3cret" not in repr(EtcdSecurity(user="root", password="s3cret"))


def test_a_loopback_worker_keeps_ucx_on_loopback() -> None:
    from libkv.transfer.setup import confine_kv_network

    env: dict[str, str] = {}
    confine_kv_network("127.0.0.1", env)
    assert env == {"UCX_NET_DEVICES": "lo"}
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}  # the operator's choice stands
    confine_kv_network("localhost", env)
    assert env == {"UCX_NET_DEVICES": "mlx5_0:1"}
    env = {}
    confine_kv_network("10.0.0.5", env)
    assert env == {}
