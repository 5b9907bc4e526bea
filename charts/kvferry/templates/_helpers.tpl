{{/*
Chart name, overridable. Truncated to 63 characters because Kubernetes names and label values
follow the DNS label limit.
*/}}
{{- define "kvferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name used as the prefix of every object: the release name, plus the chart name when the release
name does not already contain it. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "kvferry.fullname" -}}
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

{{/*
The chart label value: name-version, with "+" (invalid in label values) replaced.
*/}}
{{- define "kvferry.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of the operator pods. Never change these between chart versions: a Deployment's
selector is immutable, so a change would break `helm upgrade`.
*/}}
{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels on every object of the chart. Only the chart's own objects carry the version: the P/D
services the operator creates never do, so an operator upgrade does not roll them.
*/}}
{{- define "kvferry.labels" -}}
helm.sh/chart: {{ include "kvferry.chart" . }}
app.kubernetes.io/name: {{ include "kvferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvferry
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Name of the operator's ServiceAccount: the given name, else the full name when the chart creates it.
*/}}
{{- define "kvferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvferry.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The registry of both kvferry images. Required: no kvferry image is published anywhere, so an unset
registry would render pods that sit in ImagePullBackOff.
*/}}
{{- define "kvferry.registry" -}}
{{- required "image.registry is required: no kvferry image is published. Build and push both images (REGISTRY=<registry> docker buildx bake --push, docs/install.md), then install with --set image.registry=<registry>" .Values.image.registry }}
{{- end }}

{{/*
Operator image reference: <image.registry>/operator, then @digest when a digest is given, else :tag
with the tag defaulting to the chart's appVersion (the names docker-bake.hcl pushes).
*/}}
{{- define "kvferry.image" -}}
{{- $img := .Values.operator.image }}
{{- $repository := printf "%s/operator" (trimSuffix "/" (include "kvferry.registry" .)) }}
{{- if $img.digest }}
{{- printf "%s@%s" $repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/*
Namespaces the operator serves with scope "namespaces": the list given, else the release namespace.
Returned as a YAML list so templates can range over `fromYamlArray`.
*/}}
{{- define "kvferry.watchNamespaces" -}}
{{- if .Values.operator.watch.namespaces }}
{{- toYaml (uniq .Values.operator.watch.namespaces) }}
{{- else }}
{{- toYaml (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/*
Fail early on value combinations the schema cannot express.
*/}}
{{- define "kvferry.validate" -}}
{{- if lt (int .Values.operator.shards) 1 }}
{{- fail "operator.shards must be 1 or more" }}
{{- end }}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true: two active operators would fight over the same objects" }}
{{- end }}
{{- if and .Values.operator.watch.namespaces (ne .Values.operator.watch.scope "namespaces") }}
{{- fail "operator.watch.namespaces is only used with operator.watch.scope=namespaces" }}
{{- end }}
{{- end }}
