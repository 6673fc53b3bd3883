{{/* Names, labels and small computed values shared by every template. */}}

{{- define "pdfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "pdfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdfleet.operatorName" -}}
{{- printf "%s-operator" (include "pdfleet.fullname" .) }}
{{- end }}

{{- define "pdfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: pdfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdfleet.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pdfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdfleet.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdfleet.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The pdfleet worker image `make images` built for one platform (call with (list $ "cuda")). */}}
{{- define "pdfleet.workerImage" -}}
{{- $root := index . 0 }}
{{- printf "%s:%s-%s" $root.Values.workerImage.repository (default $root.Chart.AppVersion $root.Values.workerImage.tag) (index . 1) }}
{{- end }}

{{/* The Secret holding the Alertmanager receiver's bearer token: the admin's, or the one this chart makes. */}}
{{- define "pdfleet.alertmanagerTokenSecret" -}}
{{- default (printf "%s-alertmanager" (include "pdfleet.operatorName" .)) .Values.operator.alertmanagerTokenSecret }}
{{- end }}

{{/* True ("true") when the operator watches every namespace. */}}
{{- define "pdfleet.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}
