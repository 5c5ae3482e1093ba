{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "headroom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name for the operator's objects; the release name alone when it already
     contains the chart name, so `helm install headroom` gives `headroom`, not `headroom-headroom`. */}}
{{- define "headroom.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "headroom.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart renders. */}}
{{- define "headroom.labels" -}}
helm.sh/chart: {{ include "headroom.chart" . }}
{{ include "headroom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: headroom
{{- end }}

{{/* The operator pod's selector; immutable once installed, so it holds no version. */}}
{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "headroom.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "headroom.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator's metrics Service: a Service name is a DNS label of at most 63 characters,
     and fullname may already be 63. */}}
{{- define "headroom.metricsService" -}}
{{- include "headroom.fullname" . | trunc 55 | trimSuffix "-" }}-metrics
{{- end }}

{{/* The value the full name comes from, as headroom.fullname builds it, to start the checks'
     messages: fullnameOverride, else the release name, with nameOverride unless the release
     name contains it. */}}
{{- define "headroom.fullnameFrom" -}}
{{- if .Values.fullnameOverride }}
{{- printf "fullnameOverride: %s%s" .Values.fullnameOverride (ternary " (cut to 63 characters)" "" (gt (len .Values.fullnameOverride) 63)) }}
{{- else if and .Values.nameOverride (not (contains .Values.nameOverride .Release.Name)) }}
{{- printf "nameOverride: %s, after the release name %s (without fullnameOverride, nameOverride names the objects, not only their app.kubernetes.io/name label)" .Values.nameOverride .Release.Name }}
{{- else }}
{{- printf "the release name %s" .Release.Name }}
{{- end }}
{{- end }}

{{/* The full name names every object but the metrics Service: a DNS-1123 subdomain. The schema
     has checked fullnameOverride, but nameOverride is a label value (upper case and '_' are
     fine there) and a cut at 63 characters may end on '.'. */}}
{{- define "headroom.validateFullname" -}}
{{- $full := include "headroom.fullname" . }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $full) }}
{{- fail (printf "%s: the operator's objects would be named %s, which Kubernetes refuses: an object name is a DNS-1123 subdomain (lower-case letters, digits, '-' and '.', a letter or digit at each end of every dot-separated part). Change it, or set fullnameOverride to such a name" (include "headroom.fullnameFrom" .) $full) }}
{{- end }}
{{- end }}

{{/* The metrics Service's name, checked where service.yaml renders it: a Service name is a
     DNS-1035 label (a letter first, no '.'); from Kubernetes 1.36, whose API server relaxes it
     by default (RelaxedServiceNameValidation), a DNS-1123 label (a digit first too). The full
     name it is cut from first: helm renders service.yaml before deployment.yaml, and a name
     no object can take is the error to name. */}}
{{- define "headroom.validateMetricsService" -}}
{{- include "headroom.validateFullname" . }}
{{- $svc := include "headroom.metricsService" . }}
{{- $kube := .Capabilities.KubeVersion.Version }}
{{- $relaxed := semverCompare ">=1.36.0-0" $kube }}
{{- if not (regexMatch (ternary "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" "^[a-z]([-a-z0-9]*[a-z0-9])?$" $relaxed) $svc) }}
{{- $who := ternary "Kubernetes" (printf "Kubernetes before 1.36 (this is %s)" $kube) $relaxed }}
{{- $rule := ternary "a DNS label (lower-case letters, digits and '-'; no '.')" "a DNS-1035 label (a lower-case letter first, then lower-case letters, digits and '-'; no '.')" $relaxed }}
{{- fail (printf "%s: the metrics Service would be named %s, which %s refuses: a Service name is %s. Change it, or turn the Service off (metrics.service.enabled: false, or operator.metricsPort: 0)" (include "headroom.fullnameFrom" .) $svc $who $rule) }}
{{- end }}
{{- end }}

{{/* REPOSITORY:TAG, the tag defaulting to the chart's appVersion: the operator's image unless
     image.digest pins it, and always the pods' (the operator's --headroom-image). */}}
{{- define "headroom.taggedImage" -}}
{{- $tag := .Values.image.tag }}
{{- if and (kindIs "float64" $tag) $tag }}
{{- /* A number from a values file (tag: 2), --set-json, or the release's stored values (helm
       keeps them as JSON: --set image.tag=2, an int64 at install, is 2.0 to `helm upgrade
       --reuse-values`) reaches the chart as a float64, which cannot tell 2 from 2.0, 010, 0x10
       or 2e0, and has lost digits (1.10 is 1.1, 1234567 prints as 1.234567e+06). Any of them
       may be another image than the one meant, so none is guessed at: a string is asked for.
       0, like --set image.tag=0, is the appVersion below. */}}
{{- $shown := printf "%v" $tag }}
{{- if and (eq (floor $tag) $tag) (lt $tag 9007199254740992.0) }}
{{- $shown = printf "%.0f" $tag }}
{{- end }}
{{- fail (printf "image.tag is the number %s: a values file, --set-json or the values helm stored for this release give it as a float, which cannot tell 2 from 2.0, 010 or 0x10 and loses digits (1.10 is 1.1). Give it as a string: tag: \"%s\" in a values file, or --set-string image.tag=%s (with helm upgrade --reuse-values too), if %s is the tag you meant" $shown $shown $shown $shown) }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion $tag)) }}
{{- end }}

{{- define "headroom.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- include "headroom.taggedImage" . }}
{{- end }}
{{- end }}

{{/* "true" when the operator watches only named namespaces (no globs): its namespaced
     permissions then go into one Role per watched namespace instead of the ClusterRole. kopf
     reads `*`, `?`, `[`, an exclusion `!` and a comma-separated list as patterns. */}}
{{- define "headroom.namespacedRBAC" -}}
{{- $ok := gt (len .Values.operator.watchNamespaces) 0 }}
{{- range .Values.operator.watchNamespaces }}
{{- if regexMatch "[*?\\[!,]" . }}{{ $ok = false }}{{ end }}
{{- end }}
{{- if $ok }}true{{ end }}
{{- end }}

{{/* Cluster-scoped permissions: kopf notices the CRD being (re)installed and resolves namespace
     globs; with peering, kopf's leader election. Mirrors headroom.operator.rbac, rule for rule
     (tests/test_chart_helm.py compares them). */}}
{{- define "headroom.rules.cluster" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- if .Values.operator.peering }}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}

{{/* Namespaced permissions: the InferenceDeployments (patch only for kopf's finalizer; spec is
     never written), their status, the children applied server-side (an apply that creates the
     object is authorized as `create` as well as `patch`; the Deployment is also watched, to undo
     drift, and scaled through its scale subresource), the pods the scaling loop reads, and
     Events. Nothing else: no Secrets, no ConfigMaps. */}}
{{- define "headroom.rules.namespaced" -}}
- apiGroups: [headroom.dev]
  resources: [inferencedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [headroom.dev]
  resources: [inferencedeployments/status]
  verbs: [get, patch]
- apiGroups: [headroom.dev]
  resources: [inferencedeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* Checks no schema can express, each failing `helm install` with the value's name instead of
     installing an operator that exits, or whose liveness probe fails, at every start. */}}
{{- define "headroom.validate" -}}
{{- $op := .Values.operator }}
{{- include "headroom.validateFullname" . }}
{{- /* The operator's range for --prometheus-rate-window (rate_window_seconds: 1s..1h); the
       schema has checked the grammar, PromQL's units in order, each at most once. */}}
{{- $window := toString $op.prometheusRateWindow }}
{{- $units := dict "y" 31536000000.0 "w" 604800000.0 "d" 86400000.0 "h" 3600000.0 "m" 60000.0 "s" 1000.0 "ms" 1.0 }}
{{- $ms := 0.0 }}
{{- range regexFindAll "[0-9]+(ms|[ywdhms])" $window -1 }}
{{- $n := regexFind "^[0-9]+" . }}
{{- $digits := regexReplaceAll "^0+([0-9])" $n "${1}" }}
{{- if gt (len $digits) 15 }}
{{- $ms = 1e18 }}
{{- else }}
{{- $ms = addf $ms (mulf (float64 $digits) (get $units (trimPrefix $n .))) }}
{{- end }}
{{- end }}
{{- if or (lt $ms 1000.0) (gt $ms 3600000.0) }}
{{- fail (printf "operator.prometheusRateWindow: %s is outside 1s..1h, the range `headroom operator --prometheus-rate-window` takes" $window) }}
{{- end }}
{{- /* The kubelet probes /healthz on the pod IP: bound to loopback, it never answers (with a
       zone too: ::1%lo). */}}
{{- $health := regexReplaceAll "%.*$" (lower (toString $op.healthHost)) "" }}
{{- if or (regexMatch "^127[.]" $health) (regexMatch "^[0:]+:0*1$" $health) (regexMatch "^[0:]+:ffff:(127[.]|7f[0-9a-f]{2}:)" $health) }}
{{- fail (printf "operator.healthHost: %s is a loopback address, but the kubelet probes /healthz on the pod IP: the liveness probe would fail and restart the operator forever. Use 0.0.0.0, :: or the pod IP" $op.healthHost) }}
{{- end }}
{{- $selector := include "headroom.selectorLabels" . | fromYaml }}
{{- range $key, $_ := .Values.podLabels }}
{{- if hasKey $selector $key }}
{{- fail (printf "podLabels: %s is one of the operator pod's selector labels, which the chart sets itself; a second one makes the Deployment invalid" $key) }}
{{- end }}
{{- end }}
{{- if and $op.metricsPort (eq (int $op.metricsPort) (int $op.healthPort)) }}
{{- fail (printf "operator.healthPort and operator.metricsPort are both %d: the operator binds /healthz and /metrics each on its own port and would exit at start. Give them different ports, or metricsPort: 0 to turn /metrics off" (int $op.healthPort)) }}
{{- end }}
{{- end }}
