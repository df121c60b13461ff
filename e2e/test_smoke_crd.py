# mypy: disable-error-code="arg-type,union-attr,index,operator,call-overload"
# (the kubernetes client types every model field as Optional and bodies as models; tests pass plain
# dicts and dereference fields directly, where a None is a test failure anyway.)
"""A CustomResourceDefinition with status/scale subresources, schema and CEL validation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client

from e2e.cluster import Cluster, CommandError

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "smoke.e2e.eaas.io", "v1", "widgets"
CRD = f"""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {PLURAL}.{GROUP}
spec:
  group: {GROUP}
  scope: Namespaced
  names: {{plural: {PLURAL}, singular: widget, kind: Widget, shortNames: [wdg]}}
  versions:
    - name: {VERSION}
      served: true
      storage: true
      subresources:
        status: {{}}
        scale:
          specReplicasPath: .spec.replicas
          statusReplicasPath: .status.replicas
          labelSelectorPath: .status.selector
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [replicas, model]
              properties:
                replicas: {{type: integer, minimum: 0, maximum: 16}}
                model:
                  type: string
                  x-kubernetes-validations:
                    - {{rule: "self == oldSelf", message: "model is immutable"}}
            status:
              type: object
              properties:
                replicas: {{type: integer}}
                selector: {{type: string}}
"""


@pytest.fixture(scope="module")
def widget_crd(cluster: Cluster) -> Iterator[str]:
    """The Widget CRD, Established; deleted after the module."""
    with cluster.custom_resource_definition(CRD, PLURAL, GROUP) as name:
        yield name


def _widget(name: str, replicas: int, model: str = "tiny-moe") -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "model": model},
    }


def _create(cluster: Cluster, namespace: str, body: dict) -> dict:
    return dict(cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body))


def test_kubectl_scale_uses_the_scale_subresource(cluster: Cluster, namespace: str, widget_crd: str) -> None:
    custom = cluster.custom
    _create(cluster, namespace, _widget("w", replicas=1))
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "w", {"status": {"replicas": 1, "selector": "app=w"}}
    )

    out = cluster.kubectl("scale", "widget/w", "--replicas=3", "-n", namespace).stdout
    assert "scaled" in out
    widget = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")
    assert widget["spec"]["replicas"] == 3
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "w")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 1, "selector": "app=w"}

    # A failed precondition leaves the object alone.
    failed = cluster.kubectl(
        "scale", "wdg/w", "--current-replicas=2", "--replicas=5", "-n", namespace, check=False
    )
    assert failed.returncode != 0
    assert (
        custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")["spec"]["replicas"] == 3
    )

    # The schema's maximum also applies to writes through /scale.
    with pytest.raises(CommandError, match="16"):
        cluster.kubectl("scale", "widget/w", "--replicas=17", "-n", namespace)


def test_schema_and_cel_validation_reject_invalid_widgets(
    cluster: Cluster, namespace: str, widget_crd: str
) -> None:
    with pytest.raises(client.ApiException) as negative:
        _create(cluster, namespace, _widget("negative", replicas=-1))
    assert negative.value.status == 422
    assert "spec.replicas" in negative.value.body and "greater than or equal to 0" in negative.value.body

    with pytest.raises(client.ApiException) as missing:
        _create(cluster, namespace, {**_widget("nomodel", 1), "spec": {"replicas": 1}})
    assert missing.value.status == 422 and "spec.model" in missing.value.body

    _create(cluster, namespace, _widget("w", replicas=1, model="a"))
    with pytest.raises(client.ApiException) as immutable:
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "w", {"spec": {"model": "b"}}
        )
    assert immutable.value.status == 422 and "model is immutable" in immutable.value.body
    stored = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")
    assert stored["spec"]["model"] == "a"
    assert yaml.safe_load(cluster.kubectl("get", "wdg", "w", "-n", namespace, "-o", "yaml").stdout)[
        "spec"
    ] == {
        "replicas": 1,
        "model": "a",
    }
