"""``validate_serve_config``: a Serve config (``serve deploy`` YAML) checked against Ray Serve's own schema.

Ray Serve's ``ServeDeploySchema`` (types, required fields), a strict pass for keys its pydantic models would
silently ignore, and every specserve application's ``args`` through ``ClusterConfig.from_dict``. It needs
Ray (``ray.serve.schema``), so it lives here rather than with the renderer (``tools.serve_config``, which
imports no Ray); tests and ``tools.k8s_manifests.validate_manifest`` (given it as an argument) call it.
"""

from __future__ import annotations

import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig

# The import path of the app (deployments/app.py); tools.serve_config renders the same string, and
# tests/unit/test_launch_files.py checks that the two agree.
IMPORT_PATH = "deployments.app:build_app"


def _models_in(annotation: Any) -> list[type]:
    """Pydantic model classes inside an annotation (``Optional[M]``, ``List[M]``, ``M``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _unknown_serve_keys(doc: Any, model: type, path: str) -> list[str]:
    """Keys Ray Serve's pydantic models would silently ignore (they allow extra keys)."""
    if not isinstance(doc, dict):
        return []
    fields = model.model_fields
    names = {n: n for n in fields} | {f.alias: n for n, f in fields.items() if f.alias}
    out = []
    for key, value in doc.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            out.append(f"{where}: unknown key (Ray Serve's {model.__name__} ignores it; known here: "
                       f"{', '.join(sorted(fields))})")
            continue
        for sub in _models_in(fields[names[key]].annotation):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                out += _unknown_serve_keys(item, sub, f"{where}[{i}]" if isinstance(value, list) else where)
    return out


def validate_serve_config(doc: str | dict[str, Any]) -> list[str]:
    """Readable problems with a Serve config (YAML text or dict); [] = valid."""
    if isinstance(doc, str):
        try:
            doc = yaml.safe_load(doc)
        except yaml.YAMLError as e:
            return [f"not YAML: {e}"]
    if not isinstance(doc, dict):
        return [f"expected a mapping, got {type(doc).__name__}"]
    out: list[str] = []
    try:
        ServeDeploySchema.model_validate(doc)
    except ValidationError as e:
        out += [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    out += _unknown_serve_keys(doc, ServeDeploySchema, "")
    for i, app in enumerate(doc.get("applications") or []):
        if isinstance(app, dict) and app.get("import_path") == IMPORT_PATH:
            try:
                ClusterConfig.from_dict(app.get("args") or {})
            except ValidationError as e:  # one line per field, key path first
                out += [f"applications[{i}].args.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                        for err in e.errors()]
            except ValueError as e:  # ConfigError: already "key.path: reason"
                out.append(f"applications[{i}].args: {e}")
    return out
