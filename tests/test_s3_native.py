"""The standard-library S3 reader (`ckpttool.store.s3`): listings and ranged GETs without s3fs.

Signatures are checked against botocore's own signer at a fixed time (moto, by default,
checks none) and against moto with its IAM authentication switched on; listings and bytes
against a real moto server; retries, redirects and error bodies against a tiny local HTTP
server that answers what each test scripts.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
import urllib.parse

import pytest

pytest.importorskip("moto.server")
botocore_auth = pytest.importorskip("botocore.auth")

from ckpttool.store import s3  # noqa: E402
from storage_emulators import moto_s3  # noqa: E402

BUCKET = "native-reads"
BLOB = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: pieces of a 1000-byte buffer end short
ODD_KEY = "runs/step 1/model+v=2 é~(x)*.distcp"  # spaces, unicode, `+`, `=`, sub-delims
MANY = 1001  # one more than a ListObjectsV2 page
FIXED_TIME = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """A moto S3 server on a free port with BUCKET holding BLOB at ODD_KEY, a sibling and MANY
    tiny keys; yields its endpoint URL."""
    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    with moto_s3() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for key, body in ((ODD_KEY, BLOB), ("runs/step 1/.metadata", b"meta"), ("runs/step 10/x", b"sibling"),
                          ("runs/step 1", b"an object at the prefix itself")):
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]  # the in-process server's store: 1001 PUTs over HTTP take ~10 s
        for index in range(MANY):
            backend.put_object(BUCKET, f"many/{index:05d}", b"%d" % index)
        yield endpoint


def native(endpoint: str, **options) -> s3.S3Client:
    return s3.S3Client({"endpoint_url": endpoint, "key": "testing", "secret": "testing", **options}, environ={})


# ---------------------------------------------------------------------------------------------
# A scripted HTTP server: answers each request with the next scripted response, records all


class Scripted(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[tuple[int, dict, bytes]] = []
        self.requests: list[tuple[str, str, dict]] = []
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.server.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        status, headers, body = self.server.script.pop(0) if self.server.script else (500, {}, b"unscripted")
        self.send_response(status)
        truncated = headers.pop("truncate", None)  # claim the whole length, send `truncate` bytes, hang up
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:truncated] if truncated is not None else body)
        if truncated is not None:
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(s3, "RETRY_DELAY", 0.0)
    server = Scripted()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def error_body(code: str, message: str) -> bytes:
    return f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


def ranged(data: bytes, start: int, end: int, size: int) -> tuple[int, dict, bytes]:
    return 206, {"Content-Range": f"bytes {start}-{end - 1}/{size}", "ETag": '"v1"'}, data[start:end]


# ---------------------------------------------------------------------------------------------
# Signature Version 4: the same Authorization header as botocore's signer


@pytest.mark.parametrize("token", [None, "session/token+with=odd chars"])
@pytest.mark.parametrize("request_kind", ["get", "list"])
def test_signature_equals_botocores_for_the_same_request(scripted, monkeypatch, request_kind, token):
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    from botocore.utils import percent_encode

    fixed = __import__("datetime").datetime.fromtimestamp(FIXED_TIME, __import__("datetime").timezone.utc)
    monkeypatch.setattr(s3, "_clock", lambda: FIXED_TIME)
    monkeypatch.setattr(botocore_auth, "get_current_datetime", lambda remove_tzinfo=True: fixed.replace(tzinfo=None))
    client = s3.S3Client({"endpoint_url": scripted.endpoint, "key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI/K7MDENG+bPxRfiCY",
                          "token": token, "client_kwargs": {"region_name": "eu-west-3"}}, environ={})
    if request_kind == "get":
        scripted.script.append(ranged(BLOB, 5, 17, len(BLOB)))
        assert client.cat_file(f"{BUCKET}/{ODD_KEY}", 5, 17) == BLOB[5:17]
        url, params, headers = f"{scripted.endpoint}/{BUCKET}/{percent_encode(ODD_KEY, safe='/~')}", {}, {"Range": "bytes=5-16"}
    else:
        scripted.script.append((200, {}, b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"))
        scripted.script.append((200, {}, b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"))
        assert client.find(f"{BUCKET}/{ODD_KEY}") == {}
        url, headers = f"{scripted.endpoint}/{BUCKET}", {}
        params = {"list-type": "2", "prefix": ODD_KEY + "/", "encoding-type": "url"}
    method, path, sent = scripted.requests[0]
    request = AWSRequest(method="GET", url=url, params=params, headers=headers)
    request.context["payload_signing_enabled"] = True  # sha256 of the empty body, as we send
    botocore_auth.S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCY", token), "s3",
                              "eu-west-3").add_auth(request)
    theirs, ours = urllib.parse.urlsplit(request.prepare().url), urllib.parse.urlsplit(path)
    assert ours.path == theirs.path  # the key URI-encoded the same way
    assert sorted(urllib.parse.parse_qsl(ours.query)) == sorted(urllib.parse.parse_qsl(theirs.query))
    assert sent["authorization"] == request.headers["Authorization"]
    assert sent["x-amz-content-sha256"] == s3.EMPTY_SHA256 == request.headers["X-Amz-Content-SHA256"]
    assert sent.get("x-amz-security-token") == token


def test_moto_with_authentication_on_accepts_our_signatures_and_refuses_wrong_credentials(moto, monkeypatch):
    import boto3
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    iam = boto3.client("iam", endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing",
                       region_name="us-east-1")
    user = f"reader-{id(monkeypatch)}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    access = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the in-process server checks every request now
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    good = native(moto, key=access["AccessKeyId"], secret=access["SecretAccessKey"])
    assert good.cat_file(f"{BUCKET}/{ODD_KEY}", 100, 200) == BLOB[100:200]
    assert f"{BUCKET}/{ODD_KEY}" in good.find(f"{BUCKET}/runs/step 1")
    with pytest.raises(PermissionError, match="SignatureDoesNotMatch"):
        native(moto, key=access["AccessKeyId"], secret="wrong").cat_file(f"{BUCKET}/{ODD_KEY}", 0, 3)
    with pytest.raises(PermissionError, match="InvalidAccessKeyId"):
        native(moto, key="AKIDNOBODY", secret="x").find(f"{BUCKET}/runs")


# ---------------------------------------------------------------------------------------------
# Against moto: listings and bytes


def test_find_lists_more_than_one_page_of_keys(moto):
    found = native(moto).find(f"{BUCKET}/many")
    assert sorted(found) == [f"{BUCKET}/many/{index:05d}" for index in range(MANY)]
    assert found[f"{BUCKET}/many/01000"] == {"size": 4, "type": "file"}


def test_find_of_a_prefix_holds_the_object_at_it_and_those_under_it_but_no_siblings(moto):
    found = native(moto).find(f"{BUCKET}/runs/step 1")
    assert found == {f"{BUCKET}/runs/step 1": {"size": 30, "type": "file"},
                     f"{BUCKET}/runs/step 1/.metadata": {"size": 4, "type": "file"},
                     f"{BUCKET}/{ODD_KEY}": {"size": len(BLOB), "type": "file"}}


def test_find_of_one_object_key_and_of_a_missing_key(moto):
    client = native(moto)
    assert client.find(f"{BUCKET}/{ODD_KEY}") == {f"{BUCKET}/{ODD_KEY}": {"size": len(BLOB), "type": "file"}}
    assert client.find(f"{BUCKET}/runs/nothing") == {}


def test_a_missing_bucket_or_key_is_file_not_found_naming_it(moto):
    client = native(moto)
    with pytest.raises(FileNotFoundError, match="no bucket 'no-such-bucket'"):
        client.find("no-such-bucket/runs")
    with pytest.raises(FileNotFoundError, match="no bucket 'no-such-bucket'"):
        client.cat_file("no-such-bucket/k", 0, 1)
    with pytest.raises(FileNotFoundError, match="NoSuchKey") as caught:
        client.cat_file(f"{BUCKET}/runs/missing", 0, 1)
    assert caught.value.filename == f"s3://{BUCKET}/runs/missing"


def test_cat_file_and_pieces_return_exactly_the_uploaded_bytes(moto):
    client = native(moto)
    assert client.cat_file(f"{BUCKET}/{ODD_KEY}", 0, len(BLOB)) == BLOB
    assert client.cat_file(f"{BUCKET}/{ODD_KEY}", 1000, 1001) == BLOB[1000:1001]
    buffer = memoryview(bytearray(1000))
    views = [bytes(view) for view in client.pieces(f"{BUCKET}/{ODD_KEY}", 3, len(BLOB) - 3, buffer)]
    assert [len(v) for v in views] == [1000] * 10 + [241] and b"".join(views) == BLOB[3:]
    with pytest.raises(s3.ObjectChanged):  # the object is shorter than asked for
        client.cat_file(f"{BUCKET}/{ODD_KEY}", len(BLOB) - 4, len(BLOB) + 10)


def test_pieces_from_several_threads_each_on_its_own_connection(moto):
    from concurrent.futures import ThreadPoolExecutor

    client = native(moto)

    def read(start):
        buffer = memoryview(bytearray(333))
        return start, b"".join(bytes(v) for v in client.pieces(f"{BUCKET}/{ODD_KEY}", start, 4000, buffer))

    with ThreadPoolExecutor(4) as pool:
        for start, data in pool.map(read, range(0, 6000, 1000)):
            assert data == BLOB[start:start + 4000]


@pytest.mark.parametrize("proxy", ["s3_proxy.LatencyProxy", "fault_proxy.FaultProxy"])
def test_the_test_proxies_relay_a_204_as_headers_alone(moto, proxy):
    """The relay the test proxies share: moto answers a DELETE with 204 and no length; the
    proxy must send the headers alone (it once added `Transfer-Encoding: chunked` and a chunk
    terminator, which a 204 may not have), so the next answer on the connection follows them."""
    import importlib
    import socket

    module, name = proxy.split(".")
    request = f"DELETE /{BUCKET}/no-such-key HTTP/1.1\r\nHost: s3\r\nContent-Length: 0\r\n\r\n".encode()
    with getattr(importlib.import_module(module), name)(moto) as forward:
        host, port = urllib.parse.urlsplit(forward.endpoint).netloc.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            received = b""
            for answers in (1, 2):  # S3 answers 204 for a missing key too
                connection.sendall(request)
                while received.count(b"\r\n\r\n") < answers:
                    received += connection.recv(65536)
    first, second = received.split(b"\r\n\r\n")[:2]
    assert first.startswith(b"HTTP/1.1 204 ") and b"transfer-encoding" not in first.lower(), first
    assert second.startswith(b"HTTP/1.1 204 "), f"bytes after the first 204's headers: {second[:40]!r}"


# ---------------------------------------------------------------------------------------------
# Errors, retries, redirects (scripted server)


def test_403_with_an_s3_error_body_is_permission_error_with_code_and_message(scripted):
    scripted.script.append((403, {}, error_body("AccessDenied", "Access Denied")))
    with pytest.raises(PermissionError, match="AccessDenied: Access Denied"):
        native(scripted.endpoint).cat_file("b/k", 0, 5)
    assert len(scripted.requests) == 1  # never retried


def test_a_503_then_200_is_retried_and_a_4xx_is_not(scripted):
    scripted.script += [(503, {}, error_body("SlowDown", "Please reduce your request rate.")),
                        (500, {}, b""), ranged(BLOB, 0, 8, len(BLOB))]
    client = native(scripted.endpoint)
    assert client.cat_file("b/k", 0, 8) == BLOB[:8]
    assert len(scripted.requests) == 3
    scripted.script.append((400, {}, error_body("InvalidArgument", "bad")))
    with pytest.raises(OSError, match="HTTP 400 InvalidArgument: bad"):
        client.cat_file("b/k", 0, 8)
    assert len(scripted.requests) == 4


def test_server_errors_give_up_after_the_attempts(scripted):
    scripted.script += [(503, {}, error_body("SlowDown", "slow"))] * s3.ATTEMPTS
    with pytest.raises(OSError, match="503 SlowDown"):
        native(scripted.endpoint).cat_file("b/k", 0, 8)
    assert len(scripted.requests) == s3.ATTEMPTS


def test_a_region_redirect_is_followed_once_and_remembered_for_the_bucket(scripted):
    scripted.script += [(301, {"x-amz-bucket-region": "ap-south-1"}, error_body("PermanentRedirect", "elsewhere")),
                        ranged(BLOB, 0, 4, len(BLOB)), ranged(BLOB, 4, 8, len(BLOB))]
    client = native(scripted.endpoint)
    assert client.cat_file("b/k", 0, 4) == BLOB[:4] and client.cat_file("b/k", 4, 8) == BLOB[4:8]
    scopes = [headers["authorization"].split("Credential=")[1].split(",")[0] for _, _, headers in scripted.requests]
    assert [scope.split("/")[2] for scope in scopes] == ["us-east-1", "ap-south-1", "ap-south-1"]


def test_pieces_resume_a_dropped_body_where_it_stopped_with_if_match(scripted):
    start, end = 10, 5010
    first = ranged(BLOB, start, end, len(BLOB))
    first[1]["truncate"] = 1500
    scripted.script += [first, ranged(BLOB, start + 1500, end, len(BLOB))]
    buffer = memoryview(bytearray(1024))
    data = b"".join(bytes(v) for v in native(scripted.endpoint).pieces("b/k", start, end - start, buffer))
    assert data == BLOB[start:end]
    assert [headers["range"] for _, _, headers in scripted.requests] == ["bytes=10-5009", "bytes=1510-5009"]
    assert scripted.requests[1][2]["if-match"] == '"v1"'


def test_aws_urls_are_virtual_hosted_for_dns_bucket_names_else_path_style():
    client = s3.S3Client({"anon": True}, environ={"AWS_REGION": "eu-north-1", "AWS_CONFIG_FILE": "/nonexistent",
                                                  "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
    assert client.url("ckpts", "a b/c+d") == "https://ckpts.s3.eu-north-1.amazonaws.com/a%20b/c%2Bd"
    assert client.url("my.ckpts", "k") == "https://s3.eu-north-1.amazonaws.com/my.ckpts/k"
    assert client.url("ckpts", "k", region="cn-north-1") == "https://ckpts.s3.cn-north-1.amazonaws.com.cn/k"


def test_anonymous_requests_are_unsigned(scripted):
    scripted.script.append(ranged(BLOB, 0, 3, len(BLOB)))
    s3.S3Client({"endpoint_url": scripted.endpoint, "anon": True}, environ={}).cat_file("b/k", 0, 3)
    assert "authorization" not in scripted.requests[0][2]


# ---------------------------------------------------------------------------------------------
# Credentials and settings from the environment and profile files


def signed_with(scripted, environ, options=None) -> tuple[str, str]:
    """(access key, region) of the signature a request of a client made with `environ` carries."""
    scripted.script.append(ranged(BLOB, 0, 1, len(BLOB)))
    s3.S3Client({"endpoint_url": scripted.endpoint, **(options or {})}, environ=environ).cat_file("b/k", 0, 1)
    scope = scripted.requests[-1][2]["authorization"].split("Credential=")[1].split(",")[0].split("/")
    return scope[0], scope[2]


def test_credentials_and_region_come_from_the_profile_files(scripted, tmp_path):
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = AKIDDEFAULT\naws_secret_access_key = s\n"
                                          "[work]\naws_access_key_id = AKIDWORK\naws_secret_access_key = s\n")
    (tmp_path / "config").write_text("[default]\nregion = eu-west-1\n[profile work]\nregion = sa-east-1\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config")}
    assert signed_with(scripted, files) == ("AKIDDEFAULT", "eu-west-1")
    assert signed_with(scripted, {**files, "AWS_PROFILE": "work"}) == ("AKIDWORK", "sa-east-1")
    environment = {**files, "AWS_PROFILE": "work", "AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_SECRET_ACCESS_KEY": "s",
                   "AWS_DEFAULT_REGION": "us-west-2"}
    assert signed_with(scripted, environment) == ("AKIDENV", "us-west-2")
    assert signed_with(scripted, environment, {"key": "AKIDOPTION", "secret": "s"}) == ("AKIDOPTION", "us-west-2")


def test_without_static_credentials_botocores_chain_is_asked(scripted, tmp_path, monkeypatch):
    process = json.dumps({"Version": 1, "AccessKeyId": "AKIDPROCESS", "SecretAccessKey": "s", "SessionToken": "t",
                          "Expiration": "2999-01-01T00:00:00Z"})
    (tmp_path / "process.py").write_text(f"print({process!r})\n")
    (tmp_path / "config").write_text(f"[profile proc]\ncredential_process = {sys.executable} {tmp_path / 'process.py'}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_PROFILE", "proc")
    assert signed_with(scripted, None)[0] == "AKIDPROCESS"
    assert scripted.requests[-1][2]["x-amz-security-token"] == "t"
    monkeypatch.setitem(sys.modules, "botocore", None)
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(PermissionError, match="no AWS credentials found"):
        s3.S3Client({"endpoint_url": scripted.endpoint}).cat_file("b/k", 0, 1)


def test_importing_the_reader_imports_nothing_outside_the_standard_library():
    import subprocess

    code = ("import sys; before = set(sys.modules); import ckpttool.store.s3; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
            "('botocore', 'boto3', 's3fs', 'aiobotocore', 'fsspec', 'asyncio', 'aiohttp', 'torch')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
