#!/usr/bin/env python3
"""Removes the proxy-wasm callbacks sluice does not use from the module's
exports, in place: Envoy (proxy-wasm-cpp-host) skips a callback the module
does not export, so every request saves the trips into the VM for body and
trailer chunks. The Rust SDK exports every callback whether used or not.
Kept: proxy_on_grpc_receive and proxy_on_grpc_close, through which the
answers to global rules' calls to the rate-limit service arrive (Envoy
calls them only for those calls, never per request), and
proxy_on_queue_ready, through which a worker with a new key wakes the VM
that calls the service, and a worker that freed a shedder's slot wakes the
worker whose waiter it is left to (only then, never per request).

Usage: strip_exports.py FILE.wasm   (idempotent; standard library only)
"""

import sys

UNUSED = {
    "proxy_on_request_body", "proxy_on_request_trailers",
    "proxy_on_response_body", "proxy_on_response_trailers",
    "proxy_on_new_connection", "proxy_on_downstream_data", "proxy_on_upstream_data",
    "proxy_on_downstream_connection_close", "proxy_on_upstream_connection_close",
    "proxy_on_http_call_response", "proxy_on_grpc_receive_initial_metadata",
    "proxy_on_grpc_receive_trailing_metadata",
    "proxy_on_foreign_function",
    # Stream ends are handled when the SDK drops the context (proxy_on_delete);
    # without these exports Envoy skips two VM entries per request.
    "proxy_on_log", "proxy_on_done",
}


def leb(data, i):
    """Reads an unsigned LEB128 at i; returns (value, next index)."""
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def enc(value):
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def strip(data):
    if data[:4] != b"\0asm":
        raise ValueError("not a wasm module")
    out, i, removed = bytearray(data[:8]), 8, []
    while i < len(data):
        sid = data[i]
        size, body = leb(data, i + 1)
        end = body + size
        if sid == 7:  # export section
            count, j = leb(data, body)
            kept = []
            for _ in range(count):
                n, k = leb(data, j)
                name = data[k:k + n].decode()
                _, after = leb(data, k + n + 1)  # kind byte, then index
                if name in UNUSED:
                    removed.append(name)
                else:
                    kept.append(data[j:after])
                j = after
            content = enc(len(kept)) + b"".join(kept)
            out += bytes([sid]) + enc(len(content)) + content
        else:
            out += data[i:end]
        i = end
    return bytes(out), removed


def main():
    path = sys.argv[1]
    with open(path, "rb") as f:
        data = f.read()
    stripped, removed = strip(data)
    if removed:
        with open(path, "wb") as f:
            f.write(stripped)
    print(f"{path}: removed {len(removed)} unused exports")


if __name__ == "__main__":
    main()
