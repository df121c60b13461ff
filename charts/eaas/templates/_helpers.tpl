{{/* Name of the chart, for labels. */}}
{{- define "eaas.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Base name of the release's objects: the release name, with "eaas" appended unless it contains it. */}}
{{- define "eaas.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 55 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 55 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object of the release. */}}
{{- define "eaas.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "eaas.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: eaas
{{- end -}}

{{/* Labels selecting the operator pod. */}}
{{- define "eaas.selectorLabels" -}}
app.kubernetes.io/name: {{ include "eaas.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "eaas.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "eaas.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image reference. */}}
{{- define "eaas.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The operator's permissions: exactly the verbs it uses (kopf watches and patches its own kinds;
the reconcilers create/patch/delete the children). Shared by the ClusterRole and the Roles.
*/}}
{{- define "eaas.operatorRules" -}}
# kopf: watch the three kinds and add its finalizer (the resync timers need one).
- apiGroups: ["eaas.io"]
  resources: ["moeservices"]
  verbs: ["list", "watch", "patch"]
# MoEService reconcile: read, create and update its pools (merge patch); delete the pair of a model
# revision that no longer serves (blue/green).
- apiGroups: ["eaas.io"]
  resources: ["attentionpools", "expertpools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Status of every kind is written through /status.
- apiGroups: ["eaas.io"]
  resources: ["moeservices/status", "attentionpools/status", "expertpools/status"]
  verbs: ["patch"]
# ExpertPool replicas are written through /scale (autoscaling mode off or builtin).
- apiGroups: ["eaas.io"]
  resources: ["expertpools/scale"]
  verbs: ["patch"]
# One writer of ExpertPool replicas: an HPA (or KEDA's) on a pool the operator scales itself is
# reported, not fought.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
# Expert servers: one Pod per GPU, created and deleted one ordinal at a time.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "create", "delete"]
# Headless and client Services (server-side apply: patch, and create when it creates one); get: the
# MoEService's API Service is applied only when no other object controls one of its name.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The placement ConfigMap: read and server-side apply.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Attention clients (server-side apply; the response carries the status).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "patch"]
# Disruption budgets of each pool (server-side apply): evictions and drains take one server, or
# one attention pod, at a time.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch"]
# Heartbeats of the servers: expiry, loaded placement version, utilisation; a leaving server's
# Lease is told (patch) when no committed placement names it any more; the pods' Leases are
# watched so that a client's failover, a server's loaded placement or its leaving is acted on now.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["list", "watch", "patch"]
# The data-token Secret of each MoEService: created once, never read, listed or changed.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- if .Values.runtimeRbac.create }}
# The runtime pods' access, per MoEService: a ServiceAccount and a RoleBinding to the runtime
# ClusterRole, and no other (bind is limited to that one role by name; escalate is not granted);
# and a Role that lets them get, list and watch their placement ConfigMaps by name, with its
# RoleBinding.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create"]
# Without escalate, RBAC lets the operator grant only what it holds: the pods' Role grants list and
# watch on (named) ConfigMaps, so the operator holds them too. They show it nothing that get (above)
# does not; it uses them for nothing else.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: [{{ printf "%s-runtime" (include "eaas.fullname" .) | quote }}]
{{- end }}
# NetworkPolicies of each MoEService (server-side apply; deleted when spec.networkPolicy.enabled is false).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch", "delete"]
# Events about scaling and placement changes.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
