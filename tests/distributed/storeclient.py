"""A client of libpipe's rendezvous store written from its documentation (runtime/comm/auth.h,
runtime/comm/store_protocol.h), with Python's own hmac: what a test uses to watch the rendezvous, and an
independent implementation of the protocol (a change that breaks it fails here too)."""

import hashlib
import hmac
import os
import socket
import struct

HELLO = b"LPAUTH01"
PURPOSE = b"libpipe-store-1"


def _mac(token, role, connector, listener):
    return hmac.new(token, role + b"\0" + PURPOSE + b"\0" + connector + listener, hashlib.sha256).digest()


class StoreClient:
    def __init__(self, address, token=None, timeout=60):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        token = (token if token is not None else os.environ["LIBPIPE_TOKEN"]).encode()
        mine = os.urandom(32)
        self.sock.sendall(HELLO + mine)
        reply = self._read(8 + 32 + 32)
        if reply[:8] != HELLO:
            raise ConnectionError("not libpipe's store")
        theirs, proof = reply[8:40], reply[40:]
        if not hmac.compare_digest(proof, _mac(token, b"listener", mine, theirs)):
            raise ConnectionError("the store does not hold this token")
        self.sock.sendall(_mac(token, b"connector", mine, theirs))

    def _read(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the store closed the connection")
            data += chunk
        return data

    @staticmethod
    def _key(key):
        key = key.encode()
        return struct.pack("<I", len(key)) + key

    def check(self, keys):
        self.sock.sendall(bytes([4]) + struct.pack("<I", len(keys)) + b"".join(map(self._key, keys)))
        return self._read(1) == b"\x01"

    def add(self, key, delta):
        self.sock.sendall(bytes([3]) + self._key(key) + struct.pack("<q", delta))
        return struct.unpack("<q", self._read(8))[0]

    def close(self):
        self.sock.close()
