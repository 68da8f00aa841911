"""Why ``gs://`` has no end-to-end test here: the minimal reproduction against fake-gcs-server.

object_store (delta-rs's and obstore's store) writes a GCS object through Cloud Storage's XML
API, ``PUT /<bucket>/<object>`` with ``x-goog-if-generation-match: 0`` for a put-if-absent (the
Delta commit). fake-gcs-server serves the JSON API and routes that PUT to its JSON upload
handler, which answers ``400 invalid uploadType``. This script starts the server, creates a
bucket through the JSON API (which works), sends the XML API's PUT as object_store sends it,
and then lets delta-rs write a table to ``gs://``: it prints each answer.

Usage (builds nothing: ``GOBIN=.tools/bin go install github.com/fsouza/fake-gcs-server@v1.56.1``
first): python -m emulator.gcs_reproduction. Its output on 2026-11-26 (v1.56.1, the newest on
the Go module proxy that day; deltalake 1.6.6): the bucket 200; the XML PUT ``400 invalid
uploadType``; delta-rs's first PUT of a data file the same 400 (its listing, also XML API, is
answered once ``-public-host`` names the server).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa

from emulator.server import free_port

SERVER = Path(__file__).resolve().parent.parent / ".tools" / "bin" / "fake-gcs-server"


def request(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> str:
    call = urllib.request.Request(url, data=body or None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(call, timeout=10) as answer:
            return f"{answer.status} {answer.read()[:200]!r}"
    except urllib.error.HTTPError as refused:
        return f"{refused.code} {refused.read()[:200]!r}"


def main() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    folder = Path(tempfile.mkdtemp())
    server = subprocess.Popen(
        [
            str(SERVER),
            "-scheme",
            "http",
            "-port",
            str(port),
            "-public-host",
            f"127.0.0.1:{port}",
            "-filesystem-root",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2)
        bucket = json.dumps({"name": "lake"}).encode()
        print("JSON API, create bucket:", request("POST", f"{base}/storage/v1/b", bucket))
        xml_put = request(
            "PUT", f"{base}/lake/probe.json", b"{}", {"x-goog-if-generation-match": "0"}
        )
        print("XML API, PUT /lake/probe.json if absent:", xml_put)
        account = folder / "account.json"
        account.write_text(
            json.dumps(
                {
                    "gcs_base_url": base,
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                }
            )
        )
        from deltalake import write_deltalake

        try:
            write_deltalake(
                "gs://lake/table",
                pa.table({"n": [1]}),
                storage_options={"google_service_account": str(account)},
            )
            print("delta-rs write to gs://lake/table: ok")
        except Exception as error:  # the answer is what this script shows
            print("delta-rs write to gs://lake/table:", type(error).__name__, str(error)[:900])
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
