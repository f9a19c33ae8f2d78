"""The tests' port helpers (``llmesh.testing``): a port handed out is not handed out again until
its service has had time to bind it (a Redis started after a mesh's layout was chosen once took
the layout's gateway port, and ten tests failed on it in CI)."""

import time

from llmesh.testing import _Handed, free_layout, free_ports


def test_a_port_handed_out_lately_is_not_handed_out_again():
    handed = _Handed(keep_s=0.2)
    assert handed.take([5001, 5002])
    assert not handed.take([5002, 5003])  # one of them is taken: none is handed out
    assert handed.take([5003])
    time.sleep(0.25)
    assert handed.take([5001, 5002])  # forgotten after keep_s: bound by then, or let go


def test_layouts_and_single_ports_chosen_in_a_row_share_no_port():
    layouts = [free_layout(n_engines=4) for _ in range(20)]
    chosen = [p for lay in layouts for p in [lay.http_port, *(lay.base_port + i for i in range(4)),
                                             *(lay.base_port + 20 + i for i in range(4)),
                                             *(lay.base_port + off + i for off in (100, 200) for i in range(4))]]
    chosen += free_ports(200)
    assert len(chosen) == len(set(chosen)) == 20 * 17 + 200
