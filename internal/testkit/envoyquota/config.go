package envoyquota

import (
	"encoding/json"
	"fmt"

	rlqfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/rate_limit_quota/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
)

// ParseConfig reads a rate_limit_quota filter configuration written in YAML, as in an Envoy
// configuration file (the filter's typed_config without its "@type"), and validates it.
func ParseConfig(text string) (*rlqfilterv3.RateLimitQuotaFilterConfig, error) {
	var tree any
	if err := yaml.Unmarshal([]byte(text), &tree); err != nil {
		return nil, fmt.Errorf("envoyquota: %w", err)
	}
	js, err := json.Marshal(tree)
	if err != nil {
		return nil, fmt.Errorf("envoyquota: %w", err)
	}
	var cfg rlqfilterv3.RateLimitQuotaFilterConfig
	if err := protojson.Unmarshal(js, &cfg); err != nil {
		return nil, fmt.Errorf("envoyquota: not a RateLimitQuotaFilterConfig: %w", err)
	}
	if err := cfg.ValidateAll(); err != nil {
		return nil, fmt.Errorf("envoyquota: %w", err)
	}
	return &cfg, nil
}
