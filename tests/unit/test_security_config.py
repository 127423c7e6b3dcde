"""Secure defaults in the config and the launcher's secret handling, without Ray: token auth on by default,
``auth_mode: disabled`` only on loopback, multi-node needs the token; the Ray token file (generated once,
private, reused, refused when others can read it); the HTTP API key from a file, and the launcher moving an
inline or environment key into a private file before Ray starts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from cluster.config import BUILTIN_TINY, ClusterConfig, ConfigError, is_loopback_host
from cluster.secret_files import SecretFileError, ensure_token_file, ray_token_path, read_secret_file, state_dir
from deployments.launch import key_to_private_file, load_launch_config, ray_auth_env

TINY = {"target": {"path": BUILTIN_TINY}}
EXAMPLES = Path(__file__).resolve().parents[2] / "cluster" / "examples"


def _cfg(**sections) -> ClusterConfig:
    return ClusterConfig.from_dict({**TINY, **sections})


def test_token_auth_is_the_default_everywhere() -> None:
    assert _cfg().ray.auth_mode == "token"
    for example in EXAMPLES.glob("*.yaml"):  # read raw: some name model folders that exist only on a cluster
        ray = yaml.safe_load(example.read_text()).get("ray") or {}
        assert ray.get("auth_mode", "token") == "token", example.name


@pytest.mark.parametrize("address", [None, "local", "127.0.0.1:6379", "localhost:6379", "[::1]:6379",
                                     "127.0.0.2:6379", "ray://127.0.0.1:10001"])
def test_auth_disabled_allowed_on_loopback(address: str | None) -> None:
    cfg = _cfg(ray={"auth_mode": "disabled", "address": address})
    assert cfg.ray.loopback_only


@pytest.mark.parametrize("address", ["auto", "10.0.0.5:6379", "192.0.2.1:6379", "head.example:6379",
                                     "ray://10.0.0.5:10001", "[2001:db8::1]:6379", "0.0.0.0:6379"])
def test_auth_disabled_refused_beyond_loopback(address: str) -> None:
    with pytest.raises(ValueError, match=r"ray\.auth_mode: 'disabled' is allowed only for a cluster on loopback"):
        _cfg(ray={"auth_mode": "disabled", "address": address})
    assert not _cfg(ray={"address": address}).ray.loopback_only  # fine with the token


def test_multi_node_budget_requires_token() -> None:
    budget = {"total_gpus": 16, "gpus_per_node": 8}
    with pytest.raises(ValueError, match=r"ray\.auth_mode: cluster describes more than one node"):
        _cfg(ray={"auth_mode": "disabled"}, cluster=budget)
    assert _cfg(cluster=budget).ray.auth_mode == "token"
    _cfg(ray={"auth_mode": "disabled"}, cluster={"total_gpus": 1, "gpus_per_node": 1})  # one node


@pytest.mark.parametrize("host,loopback", [("localhost", True), ("127.0.0.1", True), ("127.1.2.3", True),
                                           ("::1", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                           ("::", False), ("10.1.1.1", False), ("example.com", False)])
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


# ---- the Ray token file --------------------------------------------------------------------------


def test_state_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert ray_token_path() == tmp_path / "specserve" / "ray_token"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "specserve"


def test_token_generated_once_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "specserve" / "ray_token"
    ensure_token_file(path)
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex, no newline
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    ensure_token_file(path)
    assert path.read_text() == token
    assert [p.name for p in path.parent.iterdir()] == ["ray_token"]  # no temporary left behind
    other = tmp_path / "other" / "ray_token"
    ensure_token_file(other)
    assert other.read_text() != token


def test_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = ensure_token_file(tmp_path / "ray_token")
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="private to it.*chmod 600"):
        ensure_token_file(path)
    path.chmod(0o600)
    path.write_text("")
    with pytest.raises(SecretFileError, match="is empty"):
        ensure_token_file(path)


def test_ray_auth_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    env = ray_auth_env(_cfg().ray)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "specserve" / "ray_token")}
    assert Path(env["RAY_AUTH_TOKEN_PATH"]).is_file()
    # Joining a cluster: Ray's own token sources, never a new token.
    assert ray_auth_env(_cfg(ray={"address": "10.0.0.5:6379"}).ray) == {"RAY_AUTH_MODE": "token"}
    assert ray_auth_env(_cfg(ray={"auth_mode": "disabled"}).ray) == {"RAY_AUTH_MODE": "disabled"}
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere")  # the user's choice wins
    assert ray_auth_env(_cfg().ray) == {"RAY_AUTH_MODE": "token"}


# ---- the HTTP API key ----------------------------------------------------------------------------


def test_api_key_from_file(tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text("sk-from-file\n")
    cfg = _cfg(http={"api_key_file": str(key_file)})
    assert cfg.http.resolve_api_key() == "sk-from-file" and cfg.http.has_api_key
    assert "sk-from-file" not in str(cfg.to_serve_args())
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match=r"^http\.api_key_file: .* is empty"):
        cfg.http.resolve_api_key()
    with pytest.raises(ConfigError, match=r"^http\.api_key_file: cannot read"):
        _cfg(http={"api_key_file": str(tmp_path / "missing")}).http.resolve_api_key()
    with pytest.raises(SecretFileError, match="^what: cannot read"):
        read_secret_file(tmp_path / "missing", "what")


@pytest.mark.parametrize("http", [{"api_key": "sk-inline"}, {"api_key_env": "SPECSERVE_UNIT_KEY"}])
def test_launcher_moves_the_key_into_a_private_file(http: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_UNIT_KEY", "sk-inline")
    moved, file = key_to_private_file(_cfg(http=http).http)
    try:
        assert file is not None and file.read_text() == "sk-inline"
        assert stat.S_IMODE(file.stat().st_mode) == 0o600 and stat.S_IMODE(file.parent.stat().st_mode) == 0o700
        args = moved.model_dump(mode="json")
        assert args["api_key"] is None and args["api_key_env"] is None and args["api_key_file"] == str(file)
        assert "sk-inline" not in str(args)
        assert "SPECSERVE_UNIT_KEY" not in os.environ or "api_key_env" not in http  # gone before Ray starts
        assert moved.resolve_api_key() == "sk-inline"
        assert ClusterConfig.from_dict({**TINY, "http": args}).http.resolve_api_key() == "sk-inline"
    finally:
        file.unlink()
        file.parent.rmdir()


def test_launcher_leaves_no_key_and_key_files_alone(tmp_path: Path) -> None:
    assert key_to_private_file(_cfg().http)[1] is None
    key_file = tmp_path / "k"
    key_file.write_text("sk")
    http, file = key_to_private_file(_cfg(http={"api_key_file": str(key_file)}).http)
    assert file is None and http.api_key_file == str(key_file)


def test_launcher_checks_the_key_file_and_makes_it_absolute(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^http\.api_key_file: cannot read"):
        key_to_private_file(_cfg(http={"api_key_file": str(tmp_path / "missing")}).http)
    monkeypatch.setenv("SPECSERVE_UNIT_KEY", "")
    with pytest.raises(ConfigError, match=r"^http\.api_key_env: environment variable SPECSERVE_UNIT_KEY"):
        key_to_private_file(_cfg(http={"api_key_env": "SPECSERVE_UNIT_KEY"}).http)
    config = tmp_path / "c.yaml"
    config.write_text(f"target: {{path: {BUILTIN_TINY}}}\nhttp: {{api_key_file: keys/api_key}}\n")
    monkeypatch.chdir(tmp_path)
    assert load_launch_config(str(config)).http.api_key_file == str(tmp_path / "keys" / "api_key")
    config.write_text(f"target: {{path: {BUILTIN_TINY}}}\nhttp: {{api_key_file: ~/api_key}}\n")
    assert load_launch_config(str(config)).http.api_key_file == "~/api_key"  # each node's own home
