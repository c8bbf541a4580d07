"""hsx-server over TLS and mTLS: the main port speaks TLS only, the plaintext health port serves the
probes (and reflection of grpc.health.v1) only, and with --tls-client-ca a client without a
certificate is refused."""

import re
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hsx_server import HsxServer
from server_helpers import N_LAYERS, error_of, wait_for


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates", pytrace=False)
    d = tmp_path_factory.mktemp("certs")

    def ssl(*args):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, cwd=d)

    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=hsx test CA", "-keyout", "ca.key", "-out", "ca.crt")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN=hsx {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *ext)
    return d


def tls_channel(srv, certs, client_cert=True):
    kwargs = dict(root_certificates=(certs / "ca.crt").read_bytes())
    if client_cert:
        kwargs.update(private_key=(certs / "client.key").read_bytes(),
                      certificate_chain=(certs / "client.crt").read_bytes())
    return grpc.secure_channel(srv.address, grpc.ssl_channel_credentials(**kwargs))


def start_tls(bin_dir, tiny, certs, *extra):
    srv = HsxServer(bin_dir, tiny, "--tls-cert", certs / "server.crt", "--tls-key", certs / "server.key",
                    "--health-listen", "127.0.0.1:0", *extra, metrics=False)
    srv.start(wait_serving=False)
    # The main port speaks TLS only; the plaintext health port serves the probes.
    wait_for(lambda: re.search(r"health \(.*\) on (\S+)", srv.text()), 30, "the health port")
    health_address = re.search(r"health \(.*\) on (\S+)", srv.text()).group(1)

    def serving():
        with grpc.insecure_channel(health_address) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="hsx.v1.HiddenStates"), timeout=5).status == 1
            except grpc.RpcError:
                return False

    wait_for(serving, 60, "SERVING on the health port")
    return srv, health_address


def test_tls_and_mtls(bin_dir, tiny, certs, hsx_pb):
    pb, pb_grpc = hsx_pb
    request = pb.ExtractRequest(token_ids=[1, 2, 3])
    srv, health_address = start_tls(bin_dir, tiny, certs)
    try:
        with tls_channel(srv, certs, client_cert=False) as ch:
            stub = pb_grpc.HiddenStatesStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).num_layers == N_LAYERS
            assert len(list(stub.Extract(request, timeout=30))) == 6
        with grpc.insecure_channel(srv.address) as ch:  # plaintext to a TLS port
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(health_address) as ch:  # the health port serves health only
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
                ProtoReflectionDescriptorDatabase
            # Reflection there describes grpc.health.v1 only (so that grpcurl can call it), no hsx service.
            assert set(ProtoReflectionDescriptorDatabase(ch).get_services()) == {
                "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    finally:
        assert srv.stop() == 0

    srv, _ = start_tls(bin_dir, tiny, certs, "--tls-client-ca", certs / "ca.crt")
    try:
        with tls_channel(srv, certs, client_cert=True) as ch:
            assert len(list(pb_grpc.HiddenStatesStub(ch).Extract(request, timeout=30))) == 6
        with tls_channel(srv, certs, client_cert=False) as ch:
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert srv.stop() == 0
    assert "mTLS" in srv.text()
