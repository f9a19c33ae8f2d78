"""`llmesh keys` and `llmesh usage` take only the options they use: usage reads Redis or
the audit logs, never the key file."""

import pytest

from llmesh.cli.main import build_parser


def test_usage_has_no_keys_file_and_keys_has_it(tmp_path, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["usage", "--keys-file", str(tmp_path / "keys.json")])
    assert info.value.code == 2 and "unrecognized arguments: --keys-file" in capsys.readouterr().err
    usage = parser.parse_args(["usage", "--redis-url", "redis://127.0.0.1:1", "--tenant", "acme"])
    assert usage.redis_url == "redis://127.0.0.1:1" and not hasattr(usage, "keys_file")
    keys = parser.parse_args(["keys", "list", "--keys-file", str(tmp_path / "keys.json")])
    assert keys.keys_file == tmp_path / "keys.json"
