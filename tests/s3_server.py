"""A real S3-compatible server for tests: moto in server mode, on loopback only.

``s3_server`` (a module-scoped fixture, import it into a test module) starts the server on
127.0.0.1 at a free port, points the standard AWS environment at it for that module only
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ..., and empty config files so nothing from the
user's ~/.aws leaks in), creates a bucket, and stops the server when the module ends.

Requires ``moto[server]``, ``boto3`` and ``s3fs``; the module using it should call
``pytest.importorskip`` for them first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

BUCKET = "dflash-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def client(self):
        """A boto3 client bound explicitly to this server (independent of the environment)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


def reset_s3_clients() -> None:
    """Forget every s3fs client of this process.

    fsspec caches file system instances by their options, not by the environment, so after
    changing AWS_* variables (or the server) a cached client would keep the old endpoint. The
    asynchronous twins Zarr uses are closed first (on Zarr's loop, where they were opened), or
    aiohttp reports their sessions as unclosed at exit.
    """
    import s3fs

    for fs in list(getattr(s3fs.S3FileSystem, "_cache", {}).values()):
        client = getattr(fs, "_s3", None)
        if fs.asynchronous and client is not None:
            try:
                from zarr.core.sync import sync

                sync(client.__aexit__(None, None, None), timeout=5)
            except Exception:  # best effort: a client of a dead loop is simply dropped
                pass
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    old_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        assert host == "127.0.0.1", host
        endpoint = f"http://{host}:{port}"
        empty = tmp_path_factory.mktemp("aws") / "empty"
        empty.write_text("")
        with pytest.MonkeyPatch.context() as mp:
            for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                        "AWS_REGION", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            mp.setenv("AWS_CONFIG_FILE", str(empty))
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
            mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
            mp.setenv("NO_PROXY", "127.0.0.1,localhost")
            reset_s3_clients()
            s3 = S3Server(endpoint=endpoint, bucket=BUCKET)
            s3.client().create_bucket(Bucket=BUCKET)
            yield s3
            reset_s3_clients()
    finally:
        server.stop()
        if getattr(server, "_server", None) is not None:
            server._server.server_close()  # stop() leaves the listening socket open
        werkzeug_log.setLevel(old_level)
