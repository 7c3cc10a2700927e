import socket

import pytest

from dsaserve.engine import ports


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ports._ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports._rng, "choice", lambda candidates: port)
        with pytest.raises(OSError, match="no free TCP port"):
            ports.free_port()
