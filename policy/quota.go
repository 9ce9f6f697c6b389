package policy

import (
	"fmt"
	"math"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/calendar"
)

// quota reads limit and burst of a mapping (rule, region, override or emergency) at path.
// Burst defaults to the limit's request count.
func (p *parser) quota(limitN, burstN *yaml.Node, path string, line int) (Quota, bool) {
	var (
		reqs   int64
		period time.Duration
		ok     = true
	)
	if limitN == nil {
		p.errf(line, join(path, "limit"), "required: requests per period, such as 100/minute")
		ok = false
	} else if ls, sok := p.str(limitN, join(path, "limit")); !sok {
		ok = false
	} else {
		var err error
		if reqs, period, err = parseLimit(ls); err != nil {
			p.errf(limitN.Line, join(path, "limit"), "%v", err)
			ok = false
		}
	}
	burst := reqs
	blLine, blField := line, join(path, "limit")
	if limitN != nil {
		blLine = limitN.Line
	}
	if burstN != nil {
		var bok bool
		if burst, bok = p.integer(burstN, join(path, "burst")); !bok {
			return Quota{}, false
		}
		blLine, blField = burstN.Line, join(path, "burst")
		if burst < 1 {
			p.errf(burstN.Line, join(path, "burst"), "%d must be at least 1 (the bucket's capacity in tokens)", burst)
			return Quota{}, false
		}
	}
	if !ok {
		return Quota{}, false
	}
	q, err := makeQuota(reqs, period, burst)
	if err != nil {
		p.errf(blLine, blField, "%v", err)
		return Quota{}, false
	}
	return q, true
}

// maxTokens is the largest token count whose microtokens stay exact (below 2^53).
const maxTokens = bucket.MaxExact / int64(bucket.PerToken)

func makeQuota(reqs int64, period time.Duration, burst int64) (Quota, error) {
	if reqs > maxTokens || burst > maxTokens {
		return Quota{}, fmt.Errorf("%d/%s burst %d: %w: more than %d tokens", reqs, FormatPeriod(period), burst, bucket.ErrUnrepresentable, maxTokens)
	}
	bl, err := bucket.NewLimit(bucket.Micro(burst)*bucket.PerToken, bucket.Micro(reqs)*bucket.PerToken,
		bucket.Millis(period/time.Millisecond))
	if err != nil {
		return Quota{}, fmt.Errorf("%d/%s burst %d: %w", reqs, FormatPeriod(period), burst, err)
	}
	return Quota{Requests: reqs, Period: period, Burst: burst, Bucket: bl}, nil
}

// parseLimit reads "N/period": N a whole number of requests, period a unit (second, minute, hour,
// day, or s, m, h, d) or a duration ("30s", "1m30s", "2d").
func parseLimit(s string) (int64, time.Duration, error) {
	ns, ps, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, fmt.Errorf("%q must be requests/period, such as 100/minute or 10/30s", s)
	}
	ns, ps = strings.TrimSpace(ns), strings.TrimSpace(ps)
	if ns == "" || strings.Trim(ns, "0123456789") != "" {
		return 0, 0, fmt.Errorf("%q: requests %q must be a whole number", s, ns)
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("%q: requests %q is out of range", s, ns)
	}
	if n < 1 {
		return 0, 0, fmt.Errorf("%q: the limit must allow at least 1 request per period", s)
	}
	d, err := parsePeriod(ps)
	if err != nil {
		return 0, 0, fmt.Errorf("%q: %w", s, err)
	}
	return n, d, nil
}

var unitPeriods = map[string]time.Duration{
	"s": time.Second, "sec": time.Second, "second": time.Second,
	"m": time.Minute, "min": time.Minute, "minute": time.Minute,
	"h": time.Hour, "hour": time.Hour,
	"d": 24 * time.Hour, "day": 24 * time.Hour,
}

// parsePeriod reads a period: a unit word or a duration in whole milliseconds, at least 1 ms.
// Besides time.ParseDuration's units it accepts whole days ("7d").
func parsePeriod(s string) (time.Duration, error) {
	if d, ok := unitPeriods[s]; ok {
		return d, nil
	}
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok && days != "" && strings.Trim(days, "0123456789") == "" {
		n, err := strconv.ParseInt(days, 10, 64)
		if err != nil || n > int64(math.MaxInt64/(24*time.Hour)) {
			return 0, fmt.Errorf("period %q is too long", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("period %q must be second, minute, hour, day or a duration such as 30s, 1m30s, 2d", s)
		}
	}
	switch {
	case d < time.Millisecond:
		return 0, fmt.Errorf("period %q must be at least 1ms", s)
	case d%time.Millisecond != 0:
		return 0, fmt.Errorf("period %q must be a whole number of milliseconds", s)
	}
	return d, nil
}

func (p *parser) emergency(n *yaml.Node, path string) (Quota, bool) {
	f, ok := p.fields(n, path, "limit", "burst")
	if !ok {
		return Quota{}, false
	}
	return p.quota(f.get("limit"), f.get("burst"), path, n.Line)
}

// regions reads the slices of a regional quota and checks that they sum to total.
func (p *parser) regions(n *yaml.Node, path string, line int, total Quota, totalOK bool) []RegionQuota {
	es := p.entries(n, path, "regions to their limit and burst")
	if len(es) == 0 {
		if n.Kind == yaml.MappingNode {
			p.errf(line, path, "must list at least one region")
		}
		return nil
	}
	if len(es) > MaxRegions {
		p.errf(line, path, "more than %d regions", MaxRegions)
		return nil
	}
	var out []RegionQuota
	ok := true
	for _, e := range es {
		rp := index(path, e.key)
		if !reRegion.MatchString(e.key) {
			p.errf(e.line, rp, "region %q must match %s", e.key, reRegion)
			ok = false
			continue
		}
		f, fok := p.fields(e.val, rp, "limit", "burst")
		if !fok {
			ok = false
			continue
		}
		q, qok := p.quota(f.get("limit"), f.get("burst"), rp, e.val.Line)
		if !qok {
			ok = false
			continue
		}
		out = append(out, RegionQuota{Region: e.key, Quota: q})
	}
	if !ok || !totalOK {
		return nil
	}
	// Compare rates as exact fractions, shown in requests per the rule's period.
	var burst int64
	perPeriod := new(big.Rat)
	parts := make([]string, len(out))
	for i, rq := range out {
		burst += rq.Burst
		num := new(big.Int).Mul(big.NewInt(rq.Requests), big.NewInt(total.Period.Milliseconds()))
		perPeriod.Add(perPeriod, new(big.Rat).SetFrac(num, big.NewInt(rq.Period.Milliseconds())))
		parts[i] = fmt.Sprintf("%s %s", rq.Region, rq.Quota)
	}
	if burst != total.Burst {
		p.errf(line, path, "region bursts sum to %d, but the rule's burst is %d (%s): slices must sum to the global quota",
			burst, total.Burst, strings.Join(parts, ", "))
	}
	if perPeriod.Cmp(big.NewRat(total.Requests, 1)) != 0 {
		p.errf(line, path, "region limits sum to %s/%s, but the rule's limit is %d/%s (%s): slices must sum to the global quota",
			perPeriod.RatString(), FormatPeriod(total.Period), total.Requests, FormatPeriod(total.Period), strings.Join(parts, ", "))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Region < out[j].Region })
	return out
}

func sameRegions(a, b []RegionQuota) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Region != b[i].Region {
			return false
		}
	}
	return true
}

func regionNames(rs []RegionQuota) string {
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.Region
	}
	return strings.Join(names, ", ")
}

// quotaCheck is an effective quota the rule's costs and emergency bucket are checked against.
type quotaCheck struct {
	what string
	q    Quota
}

func (p *parser) checkEmergency(line int, field, label string, em Quota, c quotaCheck) {
	if em.Burst >= c.q.Burst || rateCmp(em, c.q) >= 0 {
		p.errf(line, field, "%s %s must be strictly smaller than %s (%s) in both rate and burst",
			label, em, c.what, c.q)
	}
}

// quotaChecks lists the quotas a limit enforces: itself, or its region slices.
func quotaChecks(what string, q Quota, regions []RegionQuota) []quotaCheck {
	if regions == nil {
		return []quotaCheck{{what, q}}
	}
	out := make([]quotaCheck, len(regions))
	for i, rq := range regions {
		out[i] = quotaCheck{fmt.Sprintf("%s region %s", what, rq.Region), rq.Quota}
	}
	return out
}

// rateCmp compares the refill rates Requests/Period of a and b.
func rateCmp(a, b Quota) int {
	l := new(big.Int).Mul(big.NewInt(a.Requests), big.NewInt(int64(b.Period)))
	r := new(big.Int).Mul(big.NewInt(b.Requests), big.NewInt(int64(a.Period)))
	return l.Cmp(r)
}

// makeLimits resolves the limits of a rule or an override: one bucket, or one per region slice,
// each with the rule's max_debt (tokens) in µ, capped at that bucket's capacity (a runtime
// override may shrink the capacity below the rule's max_debt).
func makeLimits(q Quota, scope Scope, regions []RegionQuota, em *Quota, override bool, maxDebt int64) tenantLimits {
	debt := func(q Quota) bucket.Micro {
		// maxDebt <= the rule's burst, whose µ fit below 2^52 (bucket.NewLimit).
		return min(bucket.Micro(maxDebt)*bucket.PerToken, q.Bucket.Capacity())
	}
	if scope != Regional {
		return tenantLimits{global: &Limits{Quota: q, Fingerprint: fingerprint(q, scope, ""), Scope: scope,
			Override: override, Emergency: em, MaxDebt: debt(q)}}
	}
	tl := tenantLimits{regions: map[string]*Limits{}}
	for _, rq := range regions {
		tl.regions[rq.Region] = &Limits{Quota: rq.Quota, Fingerprint: fingerprint(rq.Quota, Regional, rq.Region),
			Scope: Regional, Region: rq.Region, Override: override, Emergency: em, MaxDebt: debt(rq.Quota)}
	}
	return tl
}

// calendarQuota reads a calendar quota ("N/day", "N/month") and its time zone (nil: UTC) at path.
func (p *parser) calendarQuota(quotaN, tzN *yaml.Node, path string) (Quota, bool) {
	fp := join(path, "quota")
	qs, ok := p.str(quotaN, fp)
	if !ok {
		return Quota{}, false
	}
	loc := time.UTC
	if tzN != nil {
		tp := join(path, "timezone")
		name, ok := p.str(tzN, tp)
		if !ok {
			return Quota{}, false
		}
		if loc, ok = p.timezone(tzN.Line, tp, name); !ok {
			return Quota{}, false
		}
	}
	q, err := parseCalendarQuota(qs, loc)
	if err != nil {
		p.errf(quotaN.Line, fp, "%v", err)
		return Quota{}, false
	}
	return q, true
}

// timezone loads a named IANA time zone ("Europe/Berlin", "UTC"). "Local" and "" are refused:
// a quota must reset at the same instant on every machine.
func (p *parser) timezone(line int, path, name string) (*time.Location, bool) {
	if name == "" || name == "Local" {
		p.errf(line, path, "%q: name an IANA time zone such as UTC or Europe/Berlin (the machine's local zone differs between hosts)", name)
		return nil, false
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		p.errf(line, path, "unknown time zone %q: name an IANA time zone such as UTC or Europe/Berlin", name)
		return nil, false
	}
	return loc, true
}

// calendarUnits are the periods of a calendar quota.
var calendarUnits = map[string]calendar.Unit{"day": calendar.Day, "month": calendar.Month}

// parseCalendarQuota reads "N/day" or "N/month" in loc.
func parseCalendarQuota(s string, loc *time.Location) (Quota, error) {
	ns, us, ok := strings.Cut(s, "/")
	ns, us = strings.TrimSpace(ns), strings.TrimSpace(us)
	unit, known := calendarUnits[us]
	switch {
	case !ok:
		return Quota{}, fmt.Errorf("%q must be requests per calendar period, such as 100000/day or 3000000/month", s)
	case !known:
		return Quota{}, fmt.Errorf("%q: a calendar quota's period is day or month (for a rolling limit over any period, use limit)", s)
	case ns == "" || strings.Trim(ns, "0123456789") != "":
		return Quota{}, fmt.Errorf("%q: requests %q must be a whole number", s, ns)
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	switch {
	case err != nil || n > maxTokens:
		return Quota{}, fmt.Errorf("%q: %w: more than %d tokens", s, bucket.ErrUnrepresentable, maxTokens)
	case n < 1:
		return Quota{}, fmt.Errorf("%q: the quota must allow at least 1 request per period", s)
	}
	bl, err := bucket.NewLimit(bucket.Micro(n)*bucket.PerToken, 0, 0)
	if err != nil {
		return Quota{}, fmt.Errorf("%q: %w", s, err)
	}
	return Quota{Requests: n, Burst: n, Bucket: bl, Calendar: &calendar.Period{Unit: unit, Loc: loc}}, nil
}
