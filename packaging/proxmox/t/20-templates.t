#!/usr/bin/perl
# Templates and linked clones as `qm template` and `qm clone` make them, and snapshots
# as `qm snapshot`/`qm rollback`/`qm delsnapshot` take them, against a real server:
# what the pool stores, what Proxmox lists, what it refuses to delete.

use strict;
use warnings;

use Test::More;

use FewerbytesTest;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
my $MIB = 1024 * 1024;

my $scfg = start_server();
$plugin->activate_storage(STOREID, $scfg, {});

sub uri { return scalar($plugin->path($scfg, $_[0], STOREID, $_[1])) }

sub qemu_io_ok {
    my ($volname, @commands) = @_;
    my $out = run_ok('qemu-io', '-f', 'raw', (map { ('-c', $_) } @commands), uri($volname));
    unlike($out, qr/(verification failed|failed:)/, "qemu-io on $volname: @commands");
}

# Bytes of live data the pool stores: not blocks freed and released at its next
# checkpoint, nor the dead space in packed blocks that compaction reclaims.
sub stored {
    my $stats = cli_json('stats');
    return $stats->{stored_bytes} - $stats->{freeing_bytes}
        - $stats->{packing_waste_bytes};
}

sub volume {
    my ($name) = @_;
    return cli_json('volume', 'info', $name);
}

# A VM disk with 16 MiB of random data: what an installed OS looks like to dedup.
my $disk = $plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 64 * 1024);
run_ok('sh', '-c', "head -c 16M /dev/urandom > $FewerbytesTest::server{dir}/os.raw");
run_ok('qemu-img', 'convert', '-n', '-f', 'raw', '-O', 'raw',
    "$FewerbytesTest::server{dir}/os.raw", uri($disk));
my $stored = stored();

# Snapshots: the pool's own, taken now; the disk moves on; rollback brings it back.
ok($plugin->volume_has_feature($scfg, 'snapshot', STOREID, $disk), 'snapshots are offered');
is($plugin->volume_qemu_snapshot_method(STOREID, $scfg, $disk), 'storage',
    'the storage takes them, also for a running VM');
$plugin->volume_snapshot($scfg, STOREID, $disk, 'before');
is(cli_json('volume', 'snapshot', 'list', 'vm-100-disk-0')->[0]->{logical_used_bytes}, 16 * $MIB,
    'the snapshot is the pool\'s vm-100-disk-0@before, holding the disk\'s 16 MiB');
is(stored(), $stored, 'and stores nothing more');
is_deeply([map { $_->{volid} } $plugin->list_images(STOREID, $scfg)->@*], ['fb:vm-100-disk-0'],
    'a snapshot is not listed as a disk');
like(uri($disk, 'before'), qr{^nbd\+unix:///vm-100-disk-0\@before\?socket=},
    'a snapshot has its own export');
my $refused = eval { run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x66 0 4k', uri($disk, 'before')) };
ok(!defined($refused), 'served read-only: qemu-io cannot write it') or diag($refused);
my $info = $plugin->volume_snapshot_info($scfg, STOREID, $disk);
my $listed = cli_json('volume', 'snapshot', 'list', 'vm-100-disk-0')->[0];
is_deeply($info, { before => { id => $listed->{guid}, timestamp => $listed->{created} } },
    'volume_snapshot_info: its identity (guid) and creation time');
like($info->{before}->{id}, qr/^[0-9a-f]{16}$/, 'the identity is 16 hex digits');
qemu_io_ok($disk, 'write -P 0x55 0 4M');
$plugin->volume_snapshot_rollback($scfg, STOREID, $disk, 'before');
like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw',
        "$FewerbytesTest::server{dir}/os.raw", uri($disk)),
    qr/Images are identical/, 'after rollback the disk holds what it held at the snapshot');
eval { $plugin->volume_snapshot_rollback($scfg, STOREID, $disk, 'never') };
like($@, qr/snapshot 'never' of 'fb:vm-100-disk-0' does not exist/, 'an unknown snapshot');
eval { $plugin->create_base(STOREID, $scfg, $disk) };
like($@, qr/while it has snapshots/, 'no template while snapshots exist');

# An older plugin's snapshot, a clone `snap:SNAP:VOLUME`: still rolled back to and
# deleted after an upgrade, and not offered to replication (no shared identity).
cli('volume', 'clone', 'vm-100-disk-0', 'snap:old:vm-100-disk-0');
qemu_io_ok($disk, 'write -P 0x77 0 4M');
like(uri($disk, 'old'), qr{^nbd\+unix:///snap:old:vm-100-disk-0\?socket=},
    'an older snapshot keeps its export');
is_deeply([sort keys $plugin->volume_snapshot_info($scfg, STOREID, $disk)->%*], ['before'],
    'volume_snapshot_info leaves the older one out');
$plugin->volume_snapshot_rollback($scfg, STOREID, $disk, 'old');
like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw',
        "$FewerbytesTest::server{dir}/os.raw", uri($disk)),
    qr/Images are identical/, 'rolled back to the older snapshot');
$plugin->volume_snapshot_delete($scfg, STOREID, $disk, 'old');
$plugin->volume_snapshot_delete($scfg, STOREID, $disk, 'before');
ok(!grep({ $_->{name} =~ /^snap:/ } cli_json('volume', 'list')->@*), 'older snapshot deleted');
is_deeply(cli_json('volume', 'snapshot', 'list', 'vm-100-disk-0'), [], 'snapshot deleted');

# free_image takes the disk's snapshots with it, both kinds.
my $scratch = $plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 1024);
$plugin->volume_snapshot($scfg, STOREID, $scratch, 'a');
cli('volume', 'clone', $scratch, "snap:b:$scratch");
$plugin->free_image(STOREID, $scfg, $scratch, 0, 'raw');
ok(!grep({ $_->{name} =~ /\Q$scratch\E/ } cli_json('volume', 'list')->@*),
    'free_image deletes the disk and its snapshots');

# qm template: the disk becomes base-100-disk-0.
my $base = $plugin->create_base(STOREID, $scfg, $disk);
is($base, 'base-100-disk-0', 'create_base names the template base-100-disk-0');
is_deeply([map { $_->{name} } cli_json('volume', 'list')->@*], ['base-100-disk-0'],
    'the pool volume was renamed, not copied');
ok($plugin->volume_has_feature($scfg, 'clone', STOREID, $base), 'a template can be cloned');
ok(!$plugin->volume_has_feature($scfg, 'clone', STOREID, 'vm-100-disk-1'),
    'a disk that is not a template cannot be linked-cloned');

# qm clone 100 101 / 102 (linked): each clone shares every block of the template.
my $clone1 = $plugin->clone_image($scfg, STOREID, $base, 101);
my $clone2 = $plugin->clone_image($scfg, STOREID, $base, 102);
is($clone1, 'base-100-disk-0/vm-101-disk-0', 'a linked clone names its template');
is($clone2, 'base-100-disk-0/vm-102-disk-0', 'and a second one');
is(stored(), $stored, 'two clones store nothing more');
for my $clone ($clone1, $clone2) {
    my $volume = volume($clone =~ s|/|+|r);
    is($volume->{logical_used_bytes}, 16 * $MIB, "$clone maps the template's 16 MiB");
    is($volume->{exclusive_stored_bytes}, 0, "$clone holds no block of its own");
    like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw', uri($base), uri($clone)),
        qr/Images are identical/, "$clone reads as the template through its path");
}
is_deeply([map { [$_->{volid}, $_->{vmid}, $_->{parent}] } $plugin->list_images(STOREID, $scfg)->@*],
    [['fb:base-100-disk-0', 100, undef],
        ['fb:base-100-disk-0/vm-101-disk-0', 101, 'base-100-disk-0'],
        ['fb:base-100-disk-0/vm-102-disk-0', 102, 'base-100-disk-0']],
    'Proxmox lists the template and its clones, each naming its parent');
is(($plugin->volume_size_info($scfg, STOREID, $clone1))[3], 'base-100-disk-0',
    'volume_size_info names the parent');

# A clone diverges without touching the template.
qemu_io_ok($clone1, 'write -P 0x66 0 1M');
is(volume('base-100-disk-0+vm-101-disk-0')->{exclusive_stored_bytes} > 0, 1,
    'a clone\'s own writes are its own blocks');
like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw',
        "$FewerbytesTest::server{dir}/os.raw", uri($base)),
    qr/Images are identical/, 'the template is unchanged');

# A template in use is not deleted (Proxmox asks the plugin who names it as a base).
eval { PVE::Storage::vdisk_free($plugin, STOREID, $scfg, "fb:$base") };
like($@, qr/base volume 'base-100-disk-0' is still in use by linked clones/,
    'the template is refused for deletion while clones use it');
ok(volume('base-100-disk-0'), 'and is still there');

# A template's disk cannot be written through Proxmox's eyes: not a resize target of a
# running VM, and a template of a template is refused.
eval { $plugin->create_base(STOREID, $scfg, $base) };
like($@, qr/create_base not possible with base image/, 'a template is already a template');
eval { $plugin->clone_image($scfg, STOREID, $base, 103, 'snap1') };
like($@, qr/linked clone of a snapshot is not supported/, 'no linked clone of a snapshot');

# A clone made a template in turn: base-100-disk-0/base-101-disk-0, then cloned.
my $base2 = $plugin->create_base(STOREID, $scfg, $clone1);
is($base2, 'base-100-disk-0/base-101-disk-0', 'a linked clone becomes a template');
my $clone3 = $plugin->clone_image($scfg, STOREID, $base2, 103);
is($clone3, 'base-101-disk-0/vm-103-disk-0', 'its clone names it');
eval { PVE::Storage::vdisk_free($plugin, STOREID, $scfg, "fb:$base2") };
like($@, qr/still in use by linked clones/, 'that template is protected too');

# Clones deleted, the template goes too, freeing what it alone held.
for my $volid ("fb:$clone3", "fb:$base2", "fb:$clone2") {
    PVE::Storage::vdisk_free($plugin, STOREID, $scfg, $volid);
}
is(stored(), $stored, 'deleting clones frees only their own blocks');
PVE::Storage::vdisk_free($plugin, STOREID, $scfg, "fb:$base");
is_deeply($plugin->list_images(STOREID, $scfg), [], 'an unused template is deleted');
my $after = cli_json('stats');
is($after->{logical_used_bytes}, 0, 'nothing is mapped any more');

stop_server();
done_testing();
