module lastcall.box/crds

go 1.26.4

require (
	github.com/prometheus-operator/prometheus-operator v0.85.0
	sigs.k8s.io/karpenter v1.13.0
)
