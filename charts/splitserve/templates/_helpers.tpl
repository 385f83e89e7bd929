{{/* Full name of the release's objects. */}}
{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: splitserve-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What each group's router may do: find its prefill and decode pods. */}}
{{- define "splitserve.routerClusterRole" -}}
{{- printf "%s-router" (include "splitserve.fullname" .) -}}
{{- end -}}

{{/* Rules on the namespaced objects the operator reconciles and creates. */}}
{{- define "splitserve.namespacedRules" -}}
- apiGroups: ["splitserve.io"]
  resources: ["servinggroups", "servingroles"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["splitserve.io"]
  resources: ["servinggroups/status", "servingroles/status"]
  verbs: ["get", "update", "patch"]
# The SLO planner sizes prefill and decode through each ServingRole's scale subresource.
- apiGroups: ["splitserve.io"]
  resources: ["servingroles/scale"]
  verbs: ["get", "update", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps", "secrets"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
# Each group's router runs as its own ServiceAccount, bound to the router ClusterRole below.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
# A NetworkPolicy per group over its engines (only the group's pods reach them) and one over its router.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: [{{ include "splitserve.routerClusterRole" . | quote }}]
# The planner marks an engine it switched to the other role (its serving-role annotation).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
