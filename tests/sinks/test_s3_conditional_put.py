"""reclock's own conditional PUT to S3 (``reclock.clients.s3.put_if_absent``,
``If-None-Match: *``, signed with AWS Signature Version 4 from the standard
library), the primitive a log entry on S3 is created with only if absent.
Its signature is compared with botocore's signer (an independent
implementation, a test dependency through moto), and moto's server, which
enforces S3's conditional writes, answers a second PUT of a key with 412."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from reclock.clients.s3 import PutRefused, S3Access, put_if_absent, signed_put
from tests.s3server import KEY_ID, REGION, SECRET

WHEN = datetime.datetime(2026, 11, 27, 21, 0, 5, tzinfo=datetime.UTC)


@pytest.mark.parametrize("endpoint, token", [
    ("http://127.0.0.1:9000", None),
    (None, "a-session-token"),
    ("https://minio.example:8443/base", None),
])
def test_the_signature_is_botocores(endpoint: str | None, token: str | None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.auth
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    access = S3Access(endpoint=endpoint, region="eu-west-3", access_key_id="AKIDEXAMPLE",
                      secret_access_key="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
                      session_token=token, allow_http=True)
    key = "tables/orders state/_delta_log/00000000000000000007.json"
    body = b'{"commitInfo":{}}\n{"txn":{"appId":"reclock:x","version":3}}\n'
    url, headers = signed_put(access, "my-bucket", key, body, now=WHEN)
    theirs = AWSRequest(method="PUT", url=url, data=body, headers={
        "Content-Type": headers["content-type"], "If-None-Match": "*",
        "X-Amz-Content-SHA256": headers["x-amz-content-sha256"]})
    auth = S3SigV4Auth(Credentials("AKIDEXAMPLE", access.secret_access_key, token),
                       "s3", "eu-west-3")
    monkeypatch.setattr(botocore.auth, "get_current_datetime",
                        lambda: WHEN.replace(tzinfo=None))
    auth.add_auth(theirs)
    assert theirs.headers["X-Amz-Date"] == headers["x-amz-date"]
    assert theirs.headers["Authorization"] == headers["authorization"]
    if endpoint is None:
        assert url == f"https://my-bucket.s3.eu-west-3.amazonaws.com/{key.replace(' ', '%20')}"


def test_a_second_put_of_a_key_is_refused_with_412(s3: Any) -> None:
    bucket = s3.bucket()
    access = S3Access(endpoint=s3.endpoint, region=REGION, access_key_id=KEY_ID,
                      secret_access_key=SECRET, allow_http=True)
    key = "t/_delta_log/00000000000000000001.json"
    assert put_if_absent(access, bucket, key, b"first\n")
    assert not put_if_absent(access, bucket, key, b"second\n")  # another writer's
    got = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert got == b"first\n"
    with pytest.raises(PutRefused, match="NoSuchBucket"):
        put_if_absent(access, f"{bucket}-absent", key, b"x\n")
    with pytest.raises(PutRefused, match="allow_http"):
        put_if_absent(S3Access(endpoint="http://127.0.0.1:1", access_key_id="a",
                               secret_access_key="b"), bucket, key, b"x\n")
