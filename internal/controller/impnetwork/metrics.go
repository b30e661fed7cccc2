package impnetwork

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"

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

// Collector returns the package's scrape-time collector, reading objects through reader (the
// manager's cache).
func Collector(reader client.Reader) prometheus.Collector { return collector{reader: reader} }
