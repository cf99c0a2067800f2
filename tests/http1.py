"""A minimal HTTP/1.1 client for load-style tests: keep-alive connections
and pipelined batches, so thousands of requests leave at once without a
third-party load generator. Only for responses with Content-Length (which
Envoy's local replies and the test upstream always send)."""

import socket
import threading
import time


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name):
        return self.headers.get(name.lower())


def build(path="/", headers=None, method="GET"):
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Conn:
    def __init__(self, port, timeout=30):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def close(self):
        self.sock.close()

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        self.buf += chunk

    def read_response(self):
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers.setdefault(k.strip().lower(), v.strip())
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return Response(status, headers, body)

    def send_all(self, requests):
        """Sends raw requests back to back, then reads one response each.
        Use one request at a time after a possible local reply."""
        self.sock.sendall(b"".join(requests))
        return [self.read_response() for _ in requests]

    def request(self, path="/", headers=None, method="GET"):
        return self.send_all([build(path, headers, method)])[0]


def get(port, path="/", headers=None, method="GET"):
    c = Conn(port)
    try:
        return c.request(path, headers, method)
    finally:
        c.close()


def burst(port, batches, sent_at=None):
    """Sends each batch (a list of raw requests) on its own keep-alive
    connection, one request after another (Envoy does not answer pipelined
    requests after a local reply). Every connection is opened first; then
    one thread sends each batch's first request in a tight loop (500 leave
    within a few milliseconds, where threads released together by a
    barrier took more than a 10 ms turn on a loaded 2-core CI runner), and
    a thread per connection reads its responses and sends the rest of its
    batch. Returns the responses in batch order; `sent_at`, a list, gets
    the time.monotonic() at which the first request left."""
    conns = [Conn(port) for _ in batches]
    results = [None] * len(batches)
    errors = []

    def run(i):
        try:
            c, batch = conns[i], batches[i]
            got = [c.read_response()] if batch else []
            for req in batch[1:]:
                got += c.send_all([req])
            results[i] = got
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    if sent_at is not None:
        sent_at.append(time.monotonic())
    try:
        for c, batch in zip(conns, batches):
            if batch:
                c.sock.sendall(batch[0])
    except Exception as e:  # reported below, once every reader has ended
        errors.append(e)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    if errors:
        raise errors[0]
    return results
