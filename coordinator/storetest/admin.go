package storetest

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// AdminStore is a store with the admin operations.
type AdminStore interface {
	coordinator.Store
	coordinator.AdminStore
}

// NewAdminStore returns an empty store (no keys) whose clock is clock.
type NewAdminStore func(t *testing.T, clock func() bucket.Millis) AdminStore

// RunAdmin runs every behaviour of coordinator.AdminStore as a subtest, each on a new store.
func RunAdmin(t *testing.T, newStore NewAdminStore) {
	for _, tc := range adminCases {
		t.Run(tc.name, func(t *testing.T) {
			f := &adminFixture{fixture: fixture{t: t, now: start}}
			f.admin = newStore(t, func() bucket.Millis { return f.now })
			f.store = f.admin
			tc.run(f)
		})
	}
}

type adminFixture struct {
	fixture
	admin AdminStore
}

func (f *adminFixture) inspect(key string, l bucket.Limit) coordinator.Snapshot {
	f.t.Helper()
	s, err := f.admin.Inspect(context.Background(), key, l)
	if err != nil {
		f.t.Fatalf("at %d: Inspect(%q): %v", f.now, key, err)
	}
	if s.Now != f.now {
		f.t.Fatalf("Inspect(%q).Now = %d, want the clock %d", key, s.Now, f.now)
	}
	return s
}

func (f *adminFixture) set(key string, l bucket.Limit, level bucket.Micro) (before, after coordinator.Snapshot) {
	f.t.Helper()
	before, after, err := f.admin.SetLevel(context.Background(), key, l, level)
	if err != nil {
		f.t.Fatalf("at %d: SetLevel(%q, %d): %v", f.now, key, level, err)
	}
	if got := f.inspect(key, l); !SameSnapshot(got, after) {
		f.t.Fatalf("after SetLevel(%q, %d): Inspect = %s, SetLevel said %s", key, level, SnapshotString(got), SnapshotString(after))
	}
	return before, after
}

// expiry is the logical expiry a key of limit l holding state st has: time to full plus the margin.
func expiry(l bucket.Limit, st bucket.State) (bucket.Millis, bool) {
	ttf, ok := st.TimeToFull(l)
	if !ok {
		return 0, false
	}
	return st.Last + ttf + coordinator.ExpiryMargin, true
}

// SameSnapshot reports whether two snapshots are equal (nil and empty record maps alike).
func SameSnapshot(a, b coordinator.Snapshot) bool {
	return a.Stored == b.Stored && a.State == b.State && a.Expires == b.Expires && a.Expiry == b.Expiry &&
		a.Now == b.Now && len(a.Takes) == len(b.Takes) && len(a.Returns) == len(b.Returns) &&
		(len(a.Takes) == 0 || reflect.DeepEqual(a.Takes, b.Takes)) &&
		(len(a.Returns) == 0 || reflect.DeepEqual(a.Returns, b.Returns)) && slices.Equal(a.Other, b.Other) &&
		len(a.Multis) == len(b.Multis) && (len(a.Multis) == 0 || reflect.DeepEqual(a.Multis, b.Multis))
}

// SnapshotString formats a snapshot for failure messages.
func SnapshotString(s coordinator.Snapshot) string {
	if !s.Stored {
		return fmt.Sprintf("{not stored, now=%d}", s.Now)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "{tokens=%d last=%d frac=%d", s.State.Tokens, s.State.Last, s.State.Frac)
	if s.Expires {
		fmt.Fprintf(&b, " expiry=%d", s.Expiry)
	}
	fmt.Fprintf(&b, " now=%d", s.Now)
	for _, a := range sortedKeys(s.Takes) {
		fmt.Fprintf(&b, " a:%s=%+v", a, s.Takes[a])
	}
	for _, a := range sortedKeys(s.Returns) {
		fmt.Fprintf(&b, " r:%s=%+v", a, s.Returns[a])
	}
	for _, a := range sortedKeys(s.Multis) {
		fmt.Fprintf(&b, " m:%s=%+v", a, s.Multis[a])
	}
	if len(s.Other) > 0 {
		fmt.Fprintf(&b, " other=%v", s.Other)
	}
	return b.String() + "}"
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

var adminCases = []struct {
	name string
	run  func(f *adminFixture)
}{
	{"InspectUnused", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		s := f.inspect("k", l)
		if s.Stored || s.Level(l) != 10*tok || len(s.Takes) != 0 {
			f.t.Fatalf("unused key: %s level %d, want not stored and full", SnapshotString(s), s.Level(l))
		}
	}},
	{"InspectAfterTakeAndReturn", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100) // 1 token per 100 ms
		t0 := f.now
		tk := take("k", l, 4*tok, tok)
		tk.Op = coordinator.OpID{Agent: "agent-1", Seq: 7}
		f.take(tk, want{granted: 4 * tok, remaining: 6 * tok, now: t0})
		f.advance(50)
		rt := ret("k", l, tok, t0)
		rt.Op = coordinator.OpID{Agent: "agent-2", Seq: 3}
		// Returned 1 token, less the 0.5 token refilled since the grant: 6.5 + 0.5 = 7 tokens.
		f.ret(rt, want{granted: tok / 2, remaining: 7 * tok, now: t0 + 50})
		f.advance(30)
		s := f.inspect("k", l)
		st := bucket.State{Tokens: 7 * tok, Last: t0 + 50}
		x, _ := expiry(l, st)
		if !s.Stored || s.State != st || !s.Expires || s.Expiry != x || len(s.Other) != 0 {
			f.t.Fatalf("Inspect = %s, want state %+v expiry %d", SnapshotString(s), st, x)
		}
		if got := s.Takes["agent-1"]; len(s.Takes) != 1 || got != (coordinator.TakeRecord{Seq: 7, Granted: 4 * tok, Remaining: 6 * tok, Now: t0}) {
			f.t.Errorf("Takes = %+v", s.Takes)
		}
		if got := s.Returns["agent-2"]; len(s.Returns) != 1 || got != (coordinator.ReturnRecord{Seq: 3, Credited: tok / 2, Remaining: 7 * tok, Now: t0 + 50}) {
			f.t.Errorf("Returns = %+v", s.Returns)
		}
		if s.Level(l) != 7*tok+3*tok/10 {
			f.t.Errorf("Level = %d, want 7.3 tokens (30 ms of refill)", s.Level(l))
		}
	}},
	{"InspectChangesNothing", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 10*tok, tok), want{granted: 10 * tok, now: f.now})
		first := f.inspect("k", l)
		f.advance(250)
		second := f.inspect("k", l)
		if second.State != first.State || second.Expiry != first.Expiry {
			f.t.Fatalf("Inspect moved the key: %s, then %s", SnapshotString(first), SnapshotString(second))
		}
		// The refill since the grant is all there, as if Inspect had not been called.
		f.take(take("k", l, 10*tok, tok), want{granted: 2*tok + tok/2, now: f.now})
		// Past its logical expiry a key is not stored, though Inspect does not drop it.
		f.advance(first.Expiry + 10*year)
		if s := f.inspect("k", l); s.Stored || s.Level(l) != 10*tok {
			f.t.Errorf("expired key: %s", SnapshotString(s))
		}
	}},
	{"SetLevel", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		t0 := f.now
		tk := take("k", l, 4*tok, tok)
		tk.Op = coordinator.OpID{Agent: "agent-1", Seq: 1}
		f.take(tk, want{granted: 4 * tok, remaining: 6 * tok, now: t0})
		f.advance(33) // 0.33 token refilled: 330000 µ
		before, after := f.set("k", l, 2*tok+1)
		if !before.Stored || before.State != (bucket.State{Tokens: 6 * tok, Last: t0}) || before.Level(l) != 6*tok+330_000 {
			f.t.Fatalf("before = %s level %d", SnapshotString(before), before.Level(l))
		}
		st := bucket.State{Tokens: 2*tok + 1, Last: t0 + 33}
		x, _ := expiry(l, st)
		if !after.Stored || after.State != st || after.Expiry != x || after.Level(l) != 2*tok+1 {
			f.t.Fatalf("after = %s, want state %+v expiry %d", SnapshotString(after), st, x)
		}
		// The agents' records stay: a retried Take is answered from its record, not charged.
		if len(after.Takes) != 1 {
			f.t.Fatalf("records after SetLevel: %+v", after.Takes)
		}
		f.take(tk, want{granted: 4 * tok, remaining: 6 * tok, now: t0, replayed: true})
		// The next Take starts from the level set.
		f.take(take("k", l, 5*tok, 3*tok), want{remaining: 2*tok + 1, retry: 100, now: f.now})
		f.advance(100)
		f.take(take("k", l, 5*tok, 3*tok), want{granted: 3*tok + 1, now: f.now})
	}},
	{"SetLevelBounds", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 4*tok, tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		was := f.inspect("k", l)
		for _, level := range []bucket.Micro{10*tok + 1, -1} {
			_, _, err := f.admin.SetLevel(context.Background(), "k", l, level)
			if !errors.Is(err, coordinator.ErrInvalidRequest) || level > 0 && !errors.Is(err, coordinator.ErrLevelAboveCapacity) {
				f.t.Errorf("SetLevel(%d) = %v, want an invalid request", level, err)
			}
		}
		if _, _, err := f.admin.SetLevel(context.Background(), "", l, tok); !errors.Is(err, coordinator.ErrInvalidRequest) {
			f.t.Errorf("SetLevel of an empty key = %v", err)
		}
		if _, err := f.admin.Inspect(context.Background(), strings.Repeat("k", coordinator.MaxKey+1), l); !errors.Is(err, coordinator.ErrInvalidRequest) {
			f.t.Errorf("Inspect of a long key = %v", err)
		}
		if now := f.inspect("k", l); !SameSnapshot(now, was) {
			f.t.Errorf("rejected calls changed the key: %s, was %s", SnapshotString(now), SnapshotString(was))
		}
		// The bounds themselves are accepted.
		f.set("k", l, 0)
		f.take(take("k", l, tok, tok), want{retry: 100, now: f.now})
		_, full := f.set("k", l, 10*tok)
		if full.Expiry != f.now+coordinator.ExpiryMargin {
			f.t.Errorf("full bucket: %s, want expiry now + margin", SnapshotString(full))
		}
	}},
	{"SetLevelUnusedAndExpired", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		before, after := f.set("new", l, 3*tok)
		if before.Stored || !after.Stored || after.State != (bucket.State{Tokens: 3 * tok, Last: f.now}) {
			f.t.Fatalf("unused key: before %s after %s", SnapshotString(before), SnapshotString(after))
		}
		tk := take("k", l, tok, tok)
		tk.Op = coordinator.OpID{Agent: "a", Seq: 1}
		f.take(tk, want{granted: tok, remaining: 9 * tok, now: f.now})
		f.advance(100 + coordinator.ExpiryMargin) // full after 100 ms, expired after the margin
		before, after = f.set("k", l, 5*tok)
		if before.Stored || len(after.Takes) != 0 || after.State != (bucket.State{Tokens: 5 * tok, Last: f.now}) {
			f.t.Fatalf("expired key: before %s after %s, want no state and no records", SnapshotString(before), SnapshotString(after))
		}
	}},
	{"SetLevelClockBack", func(f *adminFixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 4*tok, tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		last := f.now
		f.now -= 5000 // a failover to a replica whose clock is behind
		_, after := f.set("k", l, tok)
		x, _ := expiry(l, bucket.State{Tokens: tok, Last: last})
		if after.State != (bucket.State{Tokens: tok, Last: last}) || after.Expiry != x {
			f.t.Fatalf("after = %s: the key clock must stay at %d", SnapshotString(after), last)
		}
	}},
	{"SetLevelNeverRefills", func(f *adminFixture) {
		once := limit(f.t, 3*tok, 0, 0)
		_, after := f.set("once", once, tok)
		if after.Expires {
			f.t.Fatalf("a bucket that is not full and never refills expired: %s", SnapshotString(after))
		}
		_, after = f.set("once", once, 3*tok)
		if !after.Expires || after.Expiry != f.now+coordinator.ExpiryMargin {
			f.t.Fatalf("full: %s", SnapshotString(after))
		}
		_, after = f.set("once", once, 0)
		if after.Expires {
			f.t.Fatalf("empty again: %s", SnapshotString(after))
		}
		f.advance(10 * year)
		f.take(take("once", once, tok, tok), want{retry: bucket.Never, now: f.now})
	}},
	{"SetLevelFractionCleared", func(f *adminFixture) {
		l := limit(f.t, tok, tok, day) // 5 µ per 432 ms: refills leave fractions
		f.take(take("k", l, tok, tok), want{granted: tok, now: f.now})
		f.advance(1000)
		if s := f.inspect("k", l); s.State.Frac != 0 || s.Level(l) != 11 {
			f.t.Fatalf("before: %s level %d", SnapshotString(s), s.Level(l))
		}
		f.take(take("k", l, 1, 1), want{granted: 1, remaining: 10, now: f.now})
		if s := f.inspect("k", l); s.State.Frac == 0 {
			f.t.Fatalf("the refill left no fraction: %s", SnapshotString(s))
		}
		_, after := f.set("k", l, 7)
		if after.State.Frac != 0 {
			f.t.Errorf("SetLevel kept a fraction: %s", SnapshotString(after))
		}
	}},
}

// RunOverrides runs every behaviour of coordinator.OverridesStore as a subtest, each on a new,
// empty store.
func RunOverrides(t *testing.T, newStore func(t *testing.T) coordinator.OverridesStore) {
	for _, tc := range overridesCases {
		t.Run(tc.name, func(t *testing.T) {
			tc.run(&ovFixture{t: t, s: newStore(t)})
		})
	}
}

type ovFixture struct {
	t *testing.T
	s coordinator.OverridesStore
}

var roomy = coordinator.OverridesBounds{Count: 100, Bytes: 1 << 20}

func (f *ovFixture) stamp() string {
	f.t.Helper()
	s, err := f.s.OverridesStamp(context.Background())
	if err != nil {
		f.t.Fatalf("OverridesStamp: %v", err)
	}
	return s
}

// load returns the overrides sorted, and checks that the stamp goes with them.
func (f *ovFixture) load() []policy.RuntimeOverride {
	f.t.Helper()
	stamp, got, err := f.s.LoadOverrides(context.Background())
	if err != nil {
		f.t.Fatalf("LoadOverrides: %v", err)
	}
	if s := f.stamp(); s != stamp {
		f.t.Fatalf("LoadOverrides stamp %q, OverridesStamp %q", stamp, s)
	}
	slices.SortFunc(got, func(a, b policy.RuntimeOverride) int {
		return strings.Compare(a.Rule+"\x00"+a.Tenant, b.Rule+"\x00"+b.Tenant)
	})
	return got
}

func (f *ovFixture) put(o policy.RuntimeOverride, b coordinator.OverridesBounds, wantPrev string) {
	f.t.Helper()
	prev, err := f.s.PutOverride(context.Background(), o, b)
	if err != nil || prev != wantPrev {
		f.t.Fatalf("PutOverride(%+v) = %q, %v; want %q", o, prev, err, wantPrev)
	}
}

func (f *ovFixture) want(entries ...policy.RuntimeOverride) {
	f.t.Helper()
	if got := f.load(); !slices.Equal(got, entries) && len(got)+len(entries) > 0 {
		f.t.Fatalf("overrides = %+v, want %+v", got, entries)
	}
}

var overridesCases = []struct {
	name string
	run  func(f *ovFixture)
}{
	{"PutReplaceDelete", func(f *ovFixture) {
		if s := f.stamp(); s != "" {
			f.t.Fatalf("empty store: stamp %q", s)
		}
		f.want()
		a := policy.RuntimeOverride{Rule: "orders", Tenant: "acme", Spec: "{limit: 5/1m, burst: 5}"}
		f.put(a, roomy, "")
		s1 := f.stamp()
		if s1 == "" {
			f.t.Fatal("stamp empty after a put")
		}
		f.want(a)
		// The spec held: nothing changes, the stamp stays.
		f.put(a, roomy, a.Spec)
		if s := f.stamp(); s != s1 {
			f.t.Errorf("a put of the same spec moved the stamp: %q → %q", s1, s)
		}
		a2 := a
		a2.Spec = "{limit: 6/1m, burst: 6}"
		f.put(a2, roomy, a.Spec)
		s2 := f.stamp()
		if s2 == s1 {
			f.t.Error("a replaced spec kept the stamp")
		}
		b := policy.RuntimeOverride{Rule: "default", Tenant: "bigcorp", Spec: "{limit: 1/1s, burst: 1}"}
		f.put(b, roomy, "")
		f.want(b, a2)
		prev, err := f.s.DeleteOverride(context.Background(), "orders", "acme")
		if err != nil || prev != a2.Spec {
			f.t.Fatalf("DeleteOverride = %q, %v", prev, err)
		}
		s3 := f.stamp()
		f.want(b)
		if _, err := f.s.DeleteOverride(context.Background(), "orders", "acme"); !errors.Is(err, coordinator.ErrOverrideNotFound) {
			f.t.Errorf("second delete: %v, want ErrOverrideNotFound", err)
		}
		if s := f.stamp(); s != s3 || s == s2 {
			f.t.Errorf("stamps %q, %q, %q after a failed delete", s2, s3, s)
		}
		// Deleting the last one leaves no override, and a stamp that is not the empty store's.
		if _, err := f.s.DeleteOverride(context.Background(), "default", "bigcorp"); err != nil {
			f.t.Fatal(err)
		}
		f.want()
		if s := f.stamp(); s == "" || s == s3 {
			f.t.Errorf("stamp %q after deleting the last override (was %q)", s, s3)
		}
	}},
	{"Bounds", func(f *ovFixture) {
		a := policy.RuntimeOverride{Rule: "r", Tenant: "a", Spec: "0123456789"} // 12 bytes
		b := policy.RuntimeOverride{Rule: "r", Tenant: "b", Spec: "0123456789"} // 12 bytes
		c := policy.RuntimeOverride{Rule: "r", Tenant: "c", Spec: "01"}         // 4 bytes
		tight := coordinator.OverridesBounds{Count: 2, Bytes: 30}
		f.put(a, tight, "")
		f.put(b, tight, "")
		s := f.stamp()
		if _, err := f.s.PutOverride(context.Background(), c, tight); !errors.Is(err, coordinator.ErrOverridesFull) {
			f.t.Fatalf("third override with room for two: %v, want ErrOverridesFull", err)
		}
		// Replacing one at the count bound is fine, within the bytes bound.
		a2 := a
		a2.Spec = "0123456789abcdef" // 18 bytes: 30 in all
		f.put(a2, tight, a.Spec)
		a3 := a
		a3.Spec = "0123456789abcdefg" // 31 bytes in all
		if _, err := f.s.PutOverride(context.Background(), a3, tight); !errors.Is(err, coordinator.ErrOverridesFull) {
			f.t.Fatalf("replacement past the bytes bound: %v, want ErrOverridesFull", err)
		}
		f.want(a2, b)
		if f.stamp() == s {
			f.t.Error("the replacement did not move the stamp")
		}
		// Deleting makes room again: the bytes of the deleted override are given back.
		if _, err := f.s.DeleteOverride(context.Background(), "r", "a"); err != nil {
			f.t.Fatal(err)
		}
		f.put(c, tight, "")
		f.want(b, c)
		if _, err := f.s.PutOverride(context.Background(), a, tight); !errors.Is(err, coordinator.ErrOverridesFull) {
			f.t.Fatalf("third override after a delete and a put: %v, want ErrOverridesFull", err)
		}
	}},
	{"Names", func(f *ovFixture) {
		// Tenants may hold '|', '#', spaces and any UTF-8: the rule ends at the first '|'.
		var all []policy.RuntimeOverride
		for _, tenant := range []string{"a|b", "#x", "ünï cödé", "|"} {
			o := policy.RuntimeOverride{Rule: "orders-read", Tenant: tenant, Spec: "{limit: 1/1s, burst: 1}"}
			f.put(o, roomy, "")
			all = append(all, o)
		}
		slices.SortFunc(all, func(a, b policy.RuntimeOverride) int { return strings.Compare(a.Tenant, b.Tenant) })
		f.want(all...)
		for _, bad := range [][2]string{{"", "t"}, {"a|b", "t"}, {"#r", "t"}, {"r", ""}} {
			o := policy.RuntimeOverride{Rule: bad[0], Tenant: bad[1], Spec: "x"}
			if _, err := f.s.PutOverride(context.Background(), o, roomy); err == nil {
				f.t.Errorf("PutOverride(%+v) accepted", o)
			}
			if _, err := f.s.DeleteOverride(context.Background(), bad[0], bad[1]); err == nil || errors.Is(err, coordinator.ErrOverrideNotFound) {
				f.t.Errorf("DeleteOverride(%q, %q) = %v, want a rejection", bad[0], bad[1], err)
			}
		}
		f.want(all...)
	}},
}
