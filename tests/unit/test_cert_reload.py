"""`--enable-cert-reload`: `CertReloader.fetch`, which gRPC calls from its own threads before each TLS
handshake, takes a renewed pair once, keeps the last good one when a pair does not load, and agrees with
itself when several threads ask at once."""

from __future__ import annotations

import pathlib
import threading

from epp.server.tls import CertReloader, self_signed


def write(d: pathlib.Path, pair: tuple[bytes, bytes]) -> None:
    crt, key = pair
    (d / "tls.key").write_bytes(key)
    (d / "tls.crt").write_bytes(crt)


def test_a_renewed_pair_is_taken_once_and_a_broken_one_never(tmp_path: pathlib.Path) -> None:
    old, new = self_signed(), self_signed()
    write(tmp_path, old)
    r = CertReloader(str(tmp_path))
    assert r.fetch() is None and r.certificate_pem == old[0]
    write(tmp_path, new)
    assert r.fetch() is not None and r.certificate_pem == new[0] and r.reloads == 1
    assert r.fetch() is None  # unchanged since
    (tmp_path / "tls.crt").write_bytes(b"half a cert")
    assert r.fetch() is None and r.certificate_pem == new[0] and r.failures == 1
    write(tmp_path, old)  # written whole again: taken
    assert r.fetch() is not None and r.certificate_pem == old[0] and r.reloads == 2


def test_threads_asking_at_once_take_the_newest_pair_once(tmp_path: pathlib.Path) -> None:
    write(tmp_path, self_signed())
    r = CertReloader(str(tmp_path))
    newest = self_signed()
    write(tmp_path, newest)
    results: list[object] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        results.append(r.fetch())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(x is not None for x in results) == 1 and r.reloads == 1
    assert r.certificate_pem == newest[0] and r.fetch() is None
