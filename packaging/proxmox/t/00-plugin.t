#!/usr/bin/perl
# What pve-storage checks when it loads a custom plugin from
# /usr/share/perl5/PVE/Storage/Custom, and what `pvesm add` would refuse.

use strict;
use warnings;

use Test::MockModule;
use Test::More;

use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';

ok($plugin->isa('PVE::Storage::Plugin'), 'derives from PVE::Storage::Plugin');
is($plugin->type(), 'fewerbytes', 'type fewerbytes');

my $api = $plugin->api();
is($api, 15, 'claims the current storage API, 15');
cmp_ok($api, '<=', PVE::Storage::APIVER, 'not newer than the host');
cmp_ok($api, '>=', PVE::Storage::APIVER - PVE::Storage::APIAGE, 'within the age the host accepts');

{
    # On a Proxmox VE 8 host (storage API 11), the plugin claims 11 and loads.
    my $storage = Test::MockModule->new('PVE::Storage');
    $storage->redefine(APIVER => sub { 11 });
    is($plugin->api(), 11, 'on an older host it claims that host\'s version');
}

is_deeply($plugin->plugindata()->{content}, [{ images => 1 }, { images => 1 }],
    'content: images only, images by default');
is_deeply($plugin->plugindata()->{format}, [{ raw => 1 }, 'raw'], 'format: raw');

my $options = $plugin->options();
ok($options->{'fewerbytes-pool'}->{fixed}, 'the pool is fixed once added');
ok($options->{"fewerbytes-$_"}->{optional}, "fewerbytes-$_ is optional")
    for qw(socket control-socket);
ok($options->{shared}->{optional}, 'shared is an option (set for a pool on RBD)');
for my $property (keys $plugin->properties()->%*) {
    like($property, qr/^fewerbytes-/, "property $property cannot clash with another plugin's");
}

eval { $plugin->on_add_hook('fb', { content => { images => 1, rootdir => 1 } }) };
like($@, qr/VM disk images only; containers \(rootdir\)/, 'rootdir is refused, saying why');
eval { $plugin->on_add_hook('fb', { content => { images => 1 } }) };
is($@, '', 'images is accepted');

# Shared: a pool on an RBD image is the same pool from every node; a pool file is not.
my %sockets = (
    'fewerbytes-socket' => '/run/fewerbytes/vms.sock',
    'fewerbytes-control-socket' => '/run/fewerbytes/vms.ctl',
);
{
    my $scfg = { content => { images => 1 }, 'fewerbytes-pool' => 'rbd:vms/pool0', %sockets };
    eval { $plugin->on_add_hook('fb', $scfg) };
    is($@, '', 'a pool on RBD with both sockets is accepted');
    is($scfg->{shared}, 1, 'a storage whose pool is on RBD is marked shared when added');
}
{
    my $scfg = { content => { images => 1 }, 'fewerbytes-pool' => '/var/lib/fewerbytes/vms.pool' };
    $plugin->on_add_hook('fb', $scfg);
    ok(!exists($scfg->{shared}), 'a storage whose pool is a file is not marked shared');
    $scfg->{shared} = 1;
    $plugin->on_add_hook('fb', $scfg);
    is($scfg->{shared}, 1, 'an admin may still mark a pool file shared');
}
{
    my $scfg = { 'fewerbytes-pool' => '/dev/sdb' };
    $plugin->on_add_hook('fb', $scfg);
    ok(!exists($scfg->{shared}), 'a storage whose pool is a block device is not marked shared');
}

# Sockets: an RBD pool has no directory to keep them beside; they must be named.
for my $missing (sort keys %sockets) {
    my %given = %sockets;
    delete $given{$missing};
    eval { $plugin->on_add_hook('fb', { 'fewerbytes-pool' => 'rbd:vms/pool0', %given }) };
    like($@, qr{^storage 'fb': pool rbd:vms/pool0 is on RBD.*set \Q$missing\E \(for the}s,
        "a pool on RBD without $missing is refused when added, naming it");
    like($@, qr{/run/fewerbytes/NAME\.sock and /run/fewerbytes/NAME\.ctl},
        '... and the sockets of the fewerbytes@NAME service');
}
eval { $plugin->on_add_hook('fb', { 'fewerbytes-pool' => 'rbd:vms/pool0@backup' }) };
like($@, qr{set fewerbytes-socket and fewerbytes-control-socket}, 'both are named when both are missing');
{
    # A storage.cfg written by hand without them: the disk's path is refused, not guessed.
    eval { $plugin->path({ 'fewerbytes-pool' => 'rbd:vms/pool0' }, 'vm-100-disk-0') };
    like($@, qr{pool rbd:vms/pool0 is on RBD.*set fewerbytes-socket}s,
        'a disk path of a pool on RBD without sockets is refused');
    is(scalar($plugin->path({ 'fewerbytes-pool' => 'rbd:vms/pool0', %sockets }, 'vm-100-disk-0')),
        'nbd+unix:///vm-100-disk-0?socket=/run/fewerbytes/vms.sock', 'with them, QEMU gets the socket');
    is(scalar($plugin->path({ 'fewerbytes-pool' => '/p/vms.pool' }, 'vm-100-disk-0')),
        'nbd+unix:///vm-100-disk-0?socket=/p/vms.pool.sock', 'a pool file\'s socket defaults beside it');
}

# `pvesm set` cannot take a pool on RBD off shared, nor drop its sockets.
{
    my $scfg = { 'fewerbytes-pool' => 'rbd:vms/pool0', %sockets, shared => 1 };
    eval { $plugin->on_update_hook_full('fb', $scfg, { shared => 0 }, undef, {}) };
    like($@, qr{is on RBD, the same pool from every node: it stays shared}, 'shared 0 is refused');
    eval { $plugin->on_update_hook_full('fb', $scfg, {}, ['shared'], {}) };
    like($@, qr{it stays shared}, 'deleting shared is refused');
    eval { $plugin->on_update_hook_full('fb', $scfg, {}, ['fewerbytes-socket'], {}) };
    like($@, qr{set fewerbytes-socket \(}, 'deleting its NBD socket is refused');
    eval { $plugin->on_update_hook_full('fb', $scfg, { bwlimit => 'default=100' }, undef, {}) };
    is($@, '', 'other changes are accepted');
    my $file = { 'fewerbytes-pool' => '/p/vms.pool', shared => 1 };
    eval { $plugin->on_update_hook_full('fb', $file, {}, ['shared'], {}) };
    is($@, '', 'a pool file may be taken off shared');
}

for my $volname (qw(vm-100-disk-0 base-100-disk-0 base-100-disk-0/vm-101-disk-3 vm-100-cloudinit
    vm-100-state-before_upgrade)) {
    my @parsed = eval { $plugin->parse_volname($volname) };
    is($@, '', "parses $volname");
}
is_deeply([$plugin->parse_volname('base-100-disk-0/vm-101-disk-3')],
    ['images', 'vm-101-disk-3', 101, 'base-100-disk-0', 100, undef, 'raw'],
    'a linked clone names its template and the template\'s VM');
is_deeply([$plugin->parse_volname('base-100-disk-0')],
    ['images', 'base-100-disk-0', 100, undef, undef, 1, 'raw'], 'a template is a base');
for my $bad ('disk0', 'vm-100-disk+0', 'vm-x-disk-0', 'vm-100-disk-0/vm-101-disk-0',
    'snap:s1:vm-100-disk-0') {
    eval { $plugin->parse_volname($bad) };
    like($@, qr/unable to parse fewerbytes volume name/, "refuses the volume name '$bad'");
}

done_testing();
