{{/* Labels every object of the release carries. */}}
{{- define "imp.labels" -}}
app.kubernetes.io/part-of: imp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* An image reference: repository@digest when a digest is set, else repository:tag (tag
defaulting to the chart's appVersion). Call with (dict "image" .Values.x.image "root" $). */}}
{{- define "imp.image" -}}
{{- $img := .image -}}
{{- if $img.digest -}}
{{- if not (regexMatch "^sha256:[a-f0-9]{64}$" $img.digest) -}}
{{- fail (printf "image digest %q must be sha256: and 64 hex digits" $img.digest) -}}
{{- end -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end }}

{{/* A node selector that always requires imp/enabled=true: the user's selector merged over
the chart's, the opt-in label put back whatever the user gave. */}}
{{- define "imp.nodeSelector" -}}
{{- $sel := deepCopy (default (dict) .) -}}
{{- $_ := set $sel "imp/enabled" "true" -}}
{{- toYaml $sel -}}
{{- end }}

{{/* The agent's guest initramfs: the configured host path (as mounted) or the one in the agent
image. */}}
{{- define "imp.initramfs" -}}
{{- if .Values.guest.initramfs.hostPath -}}
{{- printf "/host%s" .Values.guest.initramfs.hostPath -}}
{{- else -}}
/usr/share/imp/initramfs.cpio.gz
{{- end -}}
{{- end }}

{{/* Host paths imp-runtime and the preflight mount read-only, by directory: the guest kernel's,
the initramfs' (when on the host), firecracker's and the jailer's. Each is mounted below /host,
never over the image's own directories (firecracker in /usr/local/bin would hide imp-agent). */}}
{{- define "imp.hostDirs" -}}
{{- $dirs := list (dir .Values.guest.kernel.hostPath) (dir .Values.firecracker.binary.hostPath) (dir .Values.firecracker.jailer.hostPath) -}}
{{- if .Values.guest.initramfs.hostPath -}}
{{- $dirs = append $dirs (dir .Values.guest.initramfs.hostPath) -}}
{{- end -}}
{{- toJson ($dirs | uniq | sortAlpha) -}}
{{- end }}

{{- define "imp.pins" -}}
{{- with .Values.guest.kernel.sha256 }}
- --pin-kernel={{ . }}
{{- end }}
{{- with .Values.guest.initramfs.sha256 }}
- --pin-initramfs={{ . }}
{{- end }}
{{- with .Values.firecracker.binary.sha256 }}
- --pin-firecracker={{ . }}
{{- end }}
{{- with .Values.firecracker.jailer.sha256 }}
- --pin-jailer={{ . }}
{{- end }}
{{- end }}

{{- define "imp.artifactArgs" -}}
- --kernel=/host{{ .Values.guest.kernel.hostPath }}
- --initramfs={{ include "imp.initramfs" . }}
- --firecracker=/host{{ .Values.firecracker.binary.hostPath }}
- --jailer=/host{{ .Values.firecracker.jailer.hostPath }}
{{- include "imp.pins" . }}
{{- end }}

{{/* The namespace of the access CA's Secret, which no agent may read (templates/access.yaml). */}}
{{- define "imp.accessNamespace" -}}
{{- printf "%s-access" (default "default" .Release.Namespace) -}}
{{- end }}

{{/*
The affinity of the operator's pods (and of the Jobs that run with its identity): operator.affinity,
and, unless operator.runOnVMNodes, required to be off the nodes that run VMs (imp/enabled=true),
added to each of its required node selector terms. Root on a VM node must not get the operator's
token, which reads the Secrets ImpVMs reference and holds the access CA's authority.
*/}}
{{- define "imp.operatorAffinity" -}}
{{- $aff := deepCopy (.Values.operator.affinity | default dict) -}}
{{- if not .Values.operator.runOnVMNodes -}}
{{- $off := dict "key" "imp/enabled" "operator" "NotIn" "values" (list "true") -}}
{{- $na := get $aff "nodeAffinity" | default dict -}}
{{- $req := get $na "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := list -}}
{{- range (get $req "nodeSelectorTerms" | default list) -}}
{{- $t := deepCopy . -}}
{{- $_ := set $t "matchExpressions" (append (get $t "matchExpressions" | default list) $off) -}}
{{- $terms = append $terms $t -}}
{{- end -}}
{{- if not $terms -}}
{{- $terms = list (dict "matchExpressions" (list $off)) -}}
{{- end -}}
{{- $_ := set $req "nodeSelectorTerms" $terms -}}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req -}}
{{- $_ := set $aff "nodeAffinity" $na -}}
{{- end -}}
{{- if $aff -}}
{{- toYaml $aff -}}
{{- end -}}
{{- end -}}

{{/*
The tracing flags of the operator and the agent (observability.tracing), and the Secrets they
read: imp.tracingArgs, imp.tracingMounts, imp.tracingVolumes, each a YAML list's items.
*/}}
{{- define "imp.tracingArgs" -}}
{{- with .Values.observability.tracing }}
{{- if .enabled }}
- --tracing-endpoint={{ .endpoint }}
- --tracing-protocol={{ .protocol }}
- --tracing-sample-ratio={{ .sampleRatio }}
{{- if .insecure }}
- --tracing-insecure
{{- end }}
{{- if .caSecret }}
- --tracing-ca-file=/etc/imp/tracing-ca/ca.crt
{{- end }}
{{- if .headersSecret }}
- --tracing-headers-file=/etc/imp/tracing-headers/headers
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "imp.tracingMounts" -}}
{{- with .Values.observability.tracing }}
{{- if and .enabled .caSecret }}
- name: tracing-ca
  mountPath: /etc/imp/tracing-ca
  readOnly: true
{{- end }}
{{- if and .enabled .headersSecret }}
- name: tracing-headers
  mountPath: /etc/imp/tracing-headers
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "imp.tracingVolumes" -}}
{{- with .Values.observability.tracing }}
{{- if and .enabled .caSecret }}
- name: tracing-ca
  secret:
    secretName: {{ .caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- if and .enabled .headersSecret }}
- name: tracing-headers
  secret:
    secretName: {{ .headersSecret }}
    items: [{key: headers, path: headers}]
{{- end }}
{{- end }}
{{- end }}
