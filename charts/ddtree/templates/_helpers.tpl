{{- define "ddtree.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ddtree.operatorName" -}}
{{- printf "%s-operator" (include "ddtree.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ddtree.serviceAccountName" -}}
{{- default (include "ddtree.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "ddtree.selectorLabels" -}}
app.kubernetes.io/name: ddtree-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddtree.labels" -}}
{{ include "ddtree.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* repository@digest when a digest pins the image, else repository:tag (default: appVersion). */ -}}
{{- define "ddtree.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{- /*
DDTREE_ENGINE_DEFAULTS: the engine pod settings of the values, as the JSON object the operator reads
(camelCase keys, empty settings left out).
*/ -}}
{{- define "ddtree.engineDefaults" -}}
{{- $engine := .Values.engine -}}
{{- $defaults := dict "nodeGpus" (int $engine.nodeGpus) -}}
{{- with $engine.imagePullSecrets }}{{ $_ := set $defaults "imagePullSecrets" . }}{{ end -}}
{{- with $engine.serviceAccountName }}{{ $_ := set $defaults "serviceAccountName" . }}{{ end -}}
{{- with $engine.podLabels }}{{ $_ := set $defaults "podLabels" . }}{{ end -}}
{{- with $engine.podAnnotations }}{{ $_ := set $defaults "podAnnotations" . }}{{ end -}}
{{- with $engine.priorityClassName }}{{ $_ := set $defaults "priorityClassName" . }}{{ end -}}
{{- if and $engine.cache.sizeLimit $engine.cache.existingClaim -}}
{{- fail "engine.cache: set sizeLimit (an emptyDir) or existingClaim (a PersistentVolumeClaim), not both" -}}
{{- else if $engine.cache.sizeLimit -}}
{{- $_ := set $defaults "cache" (dict "sizeLimit" $engine.cache.sizeLimit) -}}
{{- else if $engine.cache.existingClaim -}}
{{- $_ := set $defaults "cache" (dict "claimName" $engine.cache.existingClaim) -}}
{{- end -}}
{{- with .Values.autoscaling.provider }}{{ $_ := set $defaults "autoscalingProvider" . }}{{ end -}}
{{- with .Values.autoscaling.kedaPrometheusAddress }}{{ $_ := set $defaults "kedaPrometheusAddress" . }}{{ end -}}
{{- toJson $defaults -}}
{{- end -}}

{{- /*
What the operator does in the namespaces it serves: the rules of its ClusterRole when it watches all
namespaces, of a Role in each watched namespace otherwise. Exactly the verbs it uses, no wildcards.
*/ -}}
{{- define "ddtree.operatorNamespacedRules" -}}
# The custom resource: watch it, patch finalizers/annotations (kopf) and the status.
- apiGroups: [ddtree.dev]
  resources: [speculativedeployments]
  verbs: [list, watch, patch]
- apiGroups: [ddtree.dev]
  resources: [speculativedeployments/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion, which needs this.
- apiGroups: [ddtree.dev]
  resources: [speculativedeployments/finalizers]
  verbs: [update]
# Children: server-side apply (create + patch); deployments are watched for status, and a drafter canary's
# Deployment is read and deleted when the canary ends.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
# Optional children: a PodDisruptionBudget, and for spec.autoscaling an HPA (prometheus-adapter) or a KEDA
# ScaledObject; read, applied, and deleted when the spec no longer asks for them.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# Engine pods: watched for readiness, IPs (scraping) and termination messages.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# Events about smoke-test failures and handler errors.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{- define "ddtree.webhookName" -}}
{{- printf "%s-webhook" (include "ddtree.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
