package impnetwork

import (
	"context"
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

var addressesDesc = prometheus.NewDesc("imp_network_addresses",
	"Addresses of an ImpNetwork by state (allocated, free), from its status.",
	[]string{"namespace", "network", "state"}, nil)

type collector struct{ reader client.Reader }

func (c collector) Describe(ch chan<- *prometheus.Desc) { ch <- addressesDesc }

func (c collector) Collect(ch chan<- prometheus.Metric) {
	var list impv1.ImpNetworkList
	if err := c.reader.List(context.Background(), &list); err != nil {
		ch <- prometheus.NewInvalidMetric(addressesDesc, err)
		return
	}
	for _, n := range list.Items {
		ch <- prometheus.MustNewConstMetric(addressesDesc, prometheus.GaugeValue, float64(n.Status.Allocated), n.Namespace, n.Name, "allocated")
		ch <- prometheus.MustNewConstMetric(addressesDesc, prometheus.GaugeValue, float64(n.Status.Free), n.Namespace, n.Name, "free")
	}
}

// registerCollector (re)registers the collector over reader.
func registerCollector(reader client.Reader) {
	c := collector{reader: reader}
	if err := metrics.Registry.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			metrics.Registry.Unregister(are.ExistingCollector)
			metrics.Registry.MustRegister(c)
		}
	}
}
