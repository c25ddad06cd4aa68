from pathlib import Path

import pytest
from pydantic import Field

from tauflow.core.config import ConfigError, ServiceConfig, StrictModel, load_config


class Inner(StrictModel):
    size: int = 1
    name: str = "a"


class Demo(ServiceConfig):
    tau: int = Field(1, ge=-1)
    inner: Inner = Inner()


def test_sources_apply_in_order_file_env_override(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("tau: 2\ninner:\n  size: 5\n  name: from-file\nserver:\n  port: 7000\n")
    env = {"TAUFLOW_DEMO_INNER__SIZE": "6", "TAUFLOW_DEMO_TAU": "3", "OTHER": "x"}
    cfg = load_config(Demo, path=f, env_prefix="TAUFLOW_DEMO_", environ=env, overrides=["tau=-1"])
    assert cfg.tau == -1  # override beats env beats file
    assert cfg.inner.size == 6 and cfg.inner.name == "from-file"
    assert cfg.server.port == 7000 and cfg.server.host == "127.0.0.1"


def test_toml_and_json_files(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("tau = 4\n[inner]\nsize = 9\n")
    (tmp_path / "c.json").write_text('{"tau": 5}')
    assert load_config(Demo, path=tmp_path / "c.toml").inner.size == 9
    assert load_config(Demo, path=tmp_path / "c.json").tau == 5


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"overrides": ["inner.sise=3"]}, "unknown config key 'inner.sise' (from override 'inner.sise=3')"),
        (
            {"environ": {"TAUFLOW_DEMO_SERVER__PROT": "1"}},
            "unknown config key 'server.prot' (from environment variable TAUFLOW_DEMO_SERVER__PROT)",
        ),
        ({"overrides": ["tau=-2"]}, "config key 'tau' (from override 'tau=-2')"),
        ({"overrides": ["tau"]}, "must look like key.sub=value"),
        ({"overrides": ["tau.x=1"]}, "tau"),
    ],
)
def test_errors_name_the_key_and_source(kwargs, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(Demo, env_prefix="TAUFLOW_DEMO_", environ=kwargs.pop("environ", {}), **kwargs)
    assert needle in str(err.value)


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("inner:\n  colour: red\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.colour' \(from config file"):
        load_config(Demo, path=f)


def test_file_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(Demo, path=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Demo, path=tmp_path / "list.yaml")


class Backend(StrictModel):
    model_path: str
    nested: Inner = Inner()


class NeedsKeys(ServiceConfig):
    backend: Backend
    deep: Inner = Inner()
    steps: int


def test_a_missing_section_names_the_keys_it_needs() -> None:
    # "config key 'backend' (from defaults): Field required" named neither the key to set nor a real source
    with pytest.raises(ConfigError) as err:
        load_config(NeedsKeys)
    assert "config key 'backend.model_path' is required and not set" in str(err.value)
    assert "config key 'steps' is required and not set" in str(err.value)
    assert "from defaults" not in str(err.value)
    with pytest.raises(ConfigError, match="'backend.model_path' is required") as err:
        load_config(NeedsKeys, overrides=["steps=1", "backend.nested.size=2"])
    assert "steps" not in str(err.value)
