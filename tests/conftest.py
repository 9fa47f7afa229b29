"""Test-session setup that must happen before anything imports grpc.

grpcio's fork support restarts its poller thread in a forked child; when that child is a
`subprocess` about to exec (Envoy, fake model servers) and Python has closed the inherited
descriptors, the poller can hit EBADF and abort the child before it execs (grpc/grpc#43055).
The children never use gRPC, so the tests turn fork support off.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
